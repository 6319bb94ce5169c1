"""A GEMM's shape efficiency: tile and wave quantisation and the main loop's fill, by hand."""
import math

import pytest

from cost_model.hardware.cluster import PRESETS
from cost_model.hardware.compute import compute_time, gemm_efficiency

H100 = PRESETS["h100-sxm-dgx"]


def test_a_gemm_filling_whole_waves_loses_only_the_main_loops_fill():
    m, n, k = 128 * 132, 256 * 4, 8192          # 132 x 4 tiles: exactly 4 waves of 132 SMs
    assert gemm_efficiency(H100, m, n, k) == pytest.approx(k / (k + 64))


def test_one_tile_past_a_wave_costs_a_whole_wave():
    m, n, k = 128 * 133, 256, 4096               # 133 tiles: 2 waves, 133 of 264 slots busy
    assert gemm_efficiency(H100, m, n, k) == pytest.approx(133 / 264 * k / (k + 64))


def test_grouped_gemms_quantise_per_group():
    # 16 experts of 100 rows each: every expert pads its rows to one 128-row tile
    eff = gemm_efficiency(H100, 1600, 256, 2048, groups=16)
    assert eff == pytest.approx(1600 * 256 / (128 * 256) / 132 * 2048 / (2048 + 64))


def test_the_shape_slows_the_arithmetic_term_only_and_cpus_keep_the_roofline():
    flops, gemm = 2 * 1024 * 1024 * 64, (1024.0, 1024.0, 64.0, 1)
    plain = flops / (H100.peak_flops * H100.matmul_eff)
    shaped = compute_time(H100, flops, 0.0, "matmul", gemm=gemm)
    assert shaped == pytest.approx(max(plain / gemm_efficiency(H100, *gemm), H100.kernel_floor))
    cpu = PRESETS["cpu-gloo"]
    assert compute_time(cpu, flops, 0.0, "matmul", gemm=gemm) == compute_time(cpu, flops, 0.0,
                                                                              "matmul")
    assert math.isclose(gemm_efficiency(cpu, 10, 10, 10), 1.0)
