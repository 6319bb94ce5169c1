"""Runtime profiles (cost_model.hardware.runtimes): what each framework does to the hardware's
rates, each term checked on its own against its closed form, and `--runtime` through the API and
the command line."""
import dataclasses

import pytest

from cost_model.hardware.cluster import PRESETS, get_cluster
from cost_model.hardware.runtimes import ATTENTION_SHARE, PRIORS, RUNTIMES, apply, get_runtime
from cost_model.layers import layer_cost, runtime_terms
from cost_model.layers.strategy import Strategy
from planner.api import plan
from planner.cli import RUNTIME_NAMES, main

H100 = PRESETS["h100-sxm-dgx"]


def test_the_command_line_offers_every_runtime():
    assert set(RUNTIME_NAMES) == set(RUNTIMES) == set(PRIORS)


def test_a_runtime_sets_its_terms_on_the_hardware_and_nothing_else():
    hw = apply(H100, "megatron")
    rt = RUNTIMES["megatron"]
    assert (hw.runtime, hw.fused_pointwise, hw.tp_overlap, hw.comm_stream) == \
        ("megatron", True, "pipelined", True)
    assert hw.matmul_eff == pytest.approx(H100.matmul_eff * rt.compute_share)
    assert hw.attention_eff == pytest.approx(H100.attention_eff * rt.compute_share)
    assert (hw.peak_flops, hw.mem_bw, hw.inter_bw) == (H100.peak_flops, H100.mem_bw,
                                                     H100.inter_bw)
    eager = apply(H100, "torchtitan")
    assert not eager.fused_pointwise and eager.tp_overlap == "none"
    assert eager.attention_eff == pytest.approx(
        H100.attention_eff * ATTENTION_SHARE["hopper"]["fa2"] * RUNTIMES["torchtitan"].compute_share)
    a100 = apply(PRESETS["a100-80g-dgx"], "torchtitan")  # FlashAttention-2 is Ampere's best
    assert a100.attention_eff == pytest.approx(
        PRESETS["a100-80g-dgx"].attention_eff * RUNTIMES["torchtitan"].compute_share)


@pytest.mark.parametrize("call, words", [
    (lambda: get_runtime("deepspeed"), "unknown runtime 'deepspeed'; known runtimes: fxpar"),
    (lambda: apply(PRESETS["cpu-gloo"], "megatron"),
     "runtime megatron runs on GPUs; the cluster cpu-gloo is CPU ranks"),
    (lambda: apply(dataclasses.replace(H100, gpu_arch=""), "megatron"),
     "names no GPU generation"),
])
def test_bad_runtimes_are_one_line(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_a_cpu_profile_is_fxpars_runtime_as_calibrated():
    assert apply(PRESETS["cpu-gloo"]) is PRESETS["cpu-gloo"]


def _layer(tp: int):
    from planner.api import _model_costs
    from cost_model.layers.layer_cost import profile_layer
    costs, *_ = _model_costs("gpt2-small", None, 8, 1024)
    block = costs.captured.blocks[0]
    return profile_layer(costs.captured, block, tp=tp)


@pytest.mark.parametrize("mode, comm, gemm, exposed", [
    ("none", (4.0, 8.0), [10.0, 20.0], (4.0, 8.0)),
    ("backward", (4.0, 8.0), [10.0, 20.0], (4.0, 0.0)),       # half the backward GEMMs: 10
    ("backward", (4.0, 8.0), [10.0, 6.0], (4.0, 5.0)),        # only 3 of 8 hidden
    ("pipelined", (4.0, 8.0), [10.0, 20.0], (1.0, 2.0)),      # one chunk of tp = 4 exposed
    ("pipelined", (4.0, 8.0), [1.0, 20.0], (3.0, 2.0)),       # the forward GEMMs hide 1
])
def test_tensor_parallel_overlap_closed_forms(mode, comm, gemm, exposed):
    hw = dataclasses.replace(H100, tp_overlap=mode)
    assert runtime_terms.tp_exposed(hw, 4, comm, gemm) == pytest.approx(exposed)


def test_a_runtimes_tensor_parallel_overlap_shortens_a_layer():
    profile = _layer(4)
    costs = {mode: layer_cost.price(profile, Strategy(tp=True), 8, dataclasses.replace(
        H100, tp_overlap=mode), tp=4) for mode in ("none", "backward", "pipelined")}
    assert costs["none"].comm_s > costs["backward"].comm_s > costs["pipelined"].comm_s > 0
    hidden = costs["none"].comm_s - costs["pipelined"].comm_s
    assert costs["none"].fwd_s + costs["none"].bwd_s - hidden == pytest.approx(
        costs["pipelined"].fwd_s + costs["pipelined"].bwd_s)


def test_a_layer_too_small_for_its_launches_takes_their_time():
    """At one token a kernel takes microseconds: a pass takes its launches x host_op_s."""
    profile = _layer(1)
    fast = layer_cost.price(profile, Strategy(), 1, H100, tp=1)
    slow = layer_cost.price(profile, Strategy(), 1, dataclasses.replace(H100, host_op_s=50e-6))
    launched = sum(op_s > 0 for op_s in (
        layer_cost.op_seconds(op, 1 / profile.batch, H100, backward=False)
        for op in profile.ops))
    assert slow.fwd_s == pytest.approx(launched * 50e-6)
    assert fast.fwd_s < slow.fwd_s
    big = layer_cost.price(profile, Strategy(), 64, H100)   # large kernels: unchanged
    assert layer_cost.price(profile, Strategy(), 64, dataclasses.replace(
        H100, host_op_s=1e-6)).fwd_s == pytest.approx(big.fwd_s)


def test_the_optimizer_step_moves_its_bytes_at_memory_bandwidth():
    profile = _layer(1)
    cost = layer_cost.price(profile, Strategy(), 8, H100)
    hw = dataclasses.replace(H100, optimizer_bytes=28)
    assert cost.optimizer_s(hw) == pytest.approx(
        profile.params * 28 / (H100.mem_bw * H100.bw_eff))
    assert cost.optimizer_s(H100) == 0.0


def test_plan_prices_for_the_runtime_it_is_asked_for():
    fxpar = plan("llama2-7b", 64, cluster="h100-sxm-dgx")[0]
    megatron = plan("llama2-7b", 64, cluster="h100-sxm-dgx", runtime="megatron")[0]
    assert (fxpar.runtime, megatron.runtime) == ("fxpar", "megatron")
    assert "(h100-sxm-dgx, megatron runtime)" in str(megatron).splitlines()[0]
    # fused kernels, FlashAttention-3 and overlapped collectives: a faster step
    assert megatron.predicted.iteration_s < fxpar.predicted.iteration_s
    with pytest.raises(ValueError, match="already priced for the megatron runtime"):
        plan("llama2-7b", 64, cluster=apply(H100, "megatron"), runtime="torchtitan")


def test_the_command_line_runtime(capsys):
    assert main(["plan", "--model", "llama2-7b", "--gpus", "64", "--cluster", "h100-sxm-dgx",
                 "--runtime", "torchtitan"]) == 0
    assert "torchtitan runtime" in capsys.readouterr().out
    assert main(["run", "--model", "gpt-tiny", "--gpus", "2", "--runtime", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "fxpar run trains with fxpar's own runtime; --runtime megatron" in err
    assert len(err.strip().splitlines()) == 1


def test_a_calibrated_profile_measured_fxpars_runtime_and_prices_no_other():
    calibrated = dataclasses.replace(H100, action_floor=3e-6)   # runtime terms measured
    assert apply(calibrated) is calibrated
    with pytest.raises(ValueError, match="measured fxpar's own runtime"):
        apply(calibrated, "megatron")
