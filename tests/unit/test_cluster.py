"""Cluster spec, presets, JSON profiles, and the roofline compute model."""

import dataclasses
import json

import pytest

from cost_model.hardware.cluster import (
    PRESETS,
    Cluster,
    ProfileError,
    get_cluster,
    load_profile,
    save_profile,
)
from cost_model.hardware.compute import OP_CLASSES, compute_time

A100 = PRESETS["a100-80g-dgx"]


# ---------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ["cpu-gloo", "a100-80g-dgx", "h100-sxm-dgx", "h200-sxm-dgx"])
def test_preset_loads_by_name(name):
    cluster = get_cluster(name)
    assert isinstance(cluster, Cluster)
    assert cluster.name == name
    assert cluster.device == ("cpu" if name == "cpu-gloo" else "cuda")


def test_gpu_presets_match_datasheets():
    h100, h200 = PRESETS["h100-sxm-dgx"], PRESETS["h200-sxm-dgx"]
    assert (A100.peak_flops, A100.mem_bw, A100.intra_bw, A100.inter_bw) == (
        312e12, 2039e9, 300e9, 25e9)
    assert (h100.peak_flops, h100.mem_bw, h100.intra_bw, h100.inter_bw) == (
        989e12, 3350e9, 450e9, 50e9)
    assert (h200.peak_flops, h200.mem_bytes, h200.mem_bw) == (989e12, 141e9, 4800e9)
    assert all(c.gpus_per_node == 8 for c in (A100, h100, h200))


def test_get_cluster_passes_a_cluster_through():
    assert get_cluster(A100) is A100


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError) as err:
        get_cluster("tpu-v9")
    for name in PRESETS:
        assert name in str(err.value)


def test_cluster_is_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        A100.peak_flops = 1.0
    with pytest.raises(ValueError, match="matmul_eff"):
        dataclasses.replace(A100, matmul_eff=1.5)
    with pytest.raises(ValueError, match="gpus_per_node"):
        dataclasses.replace(A100, gpus_per_node=0)


# ---------------------------------------------------------------- JSON profiles
def test_json_round_trip_in_memory():
    for cluster in PRESETS.values():
        text = json.dumps(cluster.to_json())
        assert Cluster.from_json(json.loads(text)) == cluster


def test_json_round_trip_through_a_file(tmp_path):
    path = tmp_path / "a100.json"
    save_profile(A100, path)
    assert load_profile(path) == A100
    assert get_cluster(str(path)) == A100
    assert get_cluster(path) == A100


def _write_profile(tmp_path, **changes):
    data = A100.to_json()
    for key, value in changes.items():
        if value is _DROP:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


_DROP = object()


@pytest.mark.parametrize(
    "field, value",
    [
        ("peak_flops", _DROP),  # missing
        ("peak_flops", "312e12"),  # wrong type
        ("mem_bw", -1.0),  # negative
        ("intra_bw", 0.0),  # zero bandwidth would divide by zero
        ("gpus_per_node", 8.5),  # not an integer
        ("gpus_per_node", True),  # bool is not a count
        ("matmul_eff", 1.2),  # efficiency above 1
        ("device", "tpu"),
        ("name", ""),
        ("dp_overlap", None),
        ("peak_flop", 1.0),  # unknown (misspelt) extra field
    ],
)
def test_bad_field_names_file_and_field(tmp_path, field, value):
    path = _write_profile(tmp_path, **{field: value})
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert str(path) in message
    assert field in message


@pytest.mark.parametrize(
    "value, detail",
    [
        ({"p2p": {"latency": -1.0, "bandwidth": 1.0}}, "p2p.latency"),
        ({"p2p": {"latency": 1.0, "bandwidth": 0}}, "p2p.bandwidth"),
        ({"p2p": {"latency": "1", "bandwidth": 1.0}}, "p2p.latency"),
        ({"broadcast": {"latency": 1.0, "bandwidth": 1.0}}, "broadcast"),
        ({"p2p": {"latency": 1.0}}, "p2p"),
        ({"p2p": [1.0, 2.0]}, "p2p"),
        ([1.0, 2.0], "comm_corrections"),
    ],
)
def test_bad_comm_corrections_name_file_and_field(tmp_path, value, detail):
    path = _write_profile(tmp_path, comm_corrections=value)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert str(path) in message and "comm_corrections" in message and detail in message


def test_profile_without_comm_corrections_still_loads(tmp_path):
    # Profiles written before per-kind corrections existed are textbook.
    path = _write_profile(tmp_path, comm_corrections=_DROP)
    cluster = load_profile(path)
    assert cluster == A100 and cluster.comm_correction("p2p") == (1.0, 1.0)


def test_comm_corrections_round_trip(tmp_path):
    cluster = dataclasses.replace(
        A100, comm_corrections={"p2p": (0.5, 2.0), "reduce_scatter": (2.0, 0.5)})
    assert cluster.comm_correction("p2p") == (0.5, 2.0)
    assert cluster.comm_correction("all_reduce") == (1.0, 1.0)
    assert hash(cluster) == hash(dataclasses.replace(cluster))  # stays usable as a cache key
    path = tmp_path / "corrected.json"
    save_profile(cluster, path)
    assert json.loads(path.read_text())["comm_corrections"]["p2p"] == {
        "latency": 0.5, "bandwidth": 2.0}
    assert load_profile(path) == cluster


def test_cluster_rejects_bad_corrections_directly():
    with pytest.raises(ValueError, match="comm_corrections"):
        dataclasses.replace(A100, comm_corrections={"p2p": (0.0, 1.0)})
    with pytest.raises(ValueError, match="comm_corrections"):
        dataclasses.replace(A100, comm_corrections=[("p2p", 1.0, 1.0)])


def test_field_error_says_how_to_fix(tmp_path):
    path = _write_profile(tmp_path, bw_eff=-0.5)
    with pytest.raises(ProfileError, match="fxpar calibrate"):
        get_cluster(str(path))


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match="does not exist") as err:
        get_cluster(str(path))
    assert str(path) in str(err.value)
    assert "fxpar calibrate --out" in str(err.value)


def test_unreadable_file(tmp_path):
    # A directory where a file should be: open() fails even as root.
    path = tmp_path / "dir.json"
    path.mkdir()
    with pytest.raises(ProfileError, match="could not be read") as err:
        load_profile(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text", ["{not json", '{"peak_flops": NaN}', "[1, 2]", ""])
def test_not_json_or_not_an_object(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value)


def test_profile_error_is_a_value_error():
    assert issubclass(ProfileError, ValueError)


# ---------------------------------------------------------------- roofline
def test_compute_bound_matmul_uses_matmul_eff():
    flops = 1e15
    expected = flops / (A100.peak_flops * A100.matmul_eff)
    assert compute_time(A100, flops, 1e6, "matmul") == pytest.approx(expected)


def test_memory_bound_op_uses_bandwidth():
    nbytes = 1e10
    expected = nbytes / (A100.mem_bw * A100.bw_eff)
    assert compute_time(A100, 1e6, nbytes, "elementwise") == pytest.approx(expected)


def test_tiny_op_costs_the_kernel_floor():
    assert compute_time(A100, 10.0, 10.0, "norm") == A100.kernel_floor


def test_roofline_is_the_max_of_the_three():
    for flops, nbytes in [(1e12, 1e6), (1e6, 1e9), (1e3, 1e3), (1e13, 1e11)]:
        t = compute_time(A100, flops, nbytes, "matmul")
        assert t == max(flops / (A100.peak_flops * A100.matmul_eff),
                        nbytes / (A100.mem_bw * A100.bw_eff), A100.kernel_floor)


def test_matmul_overhead_is_added_to_matmuls_only():
    cpu = dataclasses.replace(PRESETS["cpu-gloo"], matmul_overhead=1e-4)
    base = PRESETS["cpu-gloo"]
    flops = 1e9
    assert compute_time(cpu, flops, 0.0, "matmul") == pytest.approx(
        compute_time(base, flops, 0.0, "matmul") + 1e-4)
    for op_class in ("attention", "norm", "elementwise"):
        assert compute_time(cpu, flops, 1e6, op_class) == compute_time(base, flops, 1e6, op_class)
    assert compute_time(cpu, 0.0, 0.0, "matmul") == base.kernel_floor
    assert all(c.matmul_overhead == 0.0 for c in PRESETS.values())


def test_profile_without_matmul_overhead_still_loads(tmp_path):
    path = _write_profile(tmp_path, matmul_overhead=_DROP)
    assert load_profile(path).matmul_overhead == 0.0
    with pytest.raises(ProfileError, match="matmul_overhead"):
        load_profile(_write_profile(tmp_path, matmul_overhead=-1.0))


def test_attention_uses_attention_eff():
    flops = 1e15
    expected = flops / (A100.peak_flops * A100.attention_eff)
    assert compute_time(A100, flops, 0.0, "attention") == pytest.approx(expected)


@pytest.mark.parametrize("op_class", ["view", "comm"])
def test_free_classes(op_class):
    assert compute_time(A100, 1e12, 1e12, op_class) == 0.0


def test_every_class_is_accepted_and_bad_input_rejected():
    for op_class in OP_CLASSES:
        assert compute_time(A100, 1e9, 1e9, op_class) >= 0.0
    with pytest.raises(ValueError, match="op_class"):
        compute_time(A100, 1.0, 1.0, "conv")
    with pytest.raises(ValueError, match="flops"):
        compute_time(A100, -1.0, 1.0, "matmul")
