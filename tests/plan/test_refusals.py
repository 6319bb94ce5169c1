"""Every refusal says which filter removed the last configurations and the nearest legal value;
identical requests give identical plans."""
import pytest

from planner.api import plan
from planner.models.presets import get_config
from planner.search.plan import GiB, Plan
from planner.search.meshes import PlanningError

TINY = "gpt-tiny"   # 8 blocks (10 layers with embed and head), 8 heads, seq 32, global batch 16


def refusal(gpus: int, model=TINY, **kwargs) -> str:
    with pytest.raises(PlanningError) as err:
        plan(model, gpus, cluster=kwargs.pop("cluster", "cpu-gloo"), **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("gpus, kwargs, words", [
    (6, dict(global_batch=8, fix={"pp": 3, "dp": 2, "schedule": "interleaved-1f1b"}),
     ["interleaved-1f1b needs the 4 micro-batches to be a multiple of pp=3", "legal schedule"]),
    (6, dict(fix={"pp": 3, "dp": 2, "schedule": "interleaved-1f1b", "mb": 4}),
     ["needs the 2 micro-batches to be a multiple of pp=3"]),
    (8, dict(model=get_config(TINY, layers=5), fix={"pp": 8}),
     ["pp=8 exceeds the 7 layers", "nearest legal pp: 4"]),
    (3, dict(global_batch=8, fix={"dp": 3}),
     ["global batch 8 is not divisible by dp=3", "nearest legal dp: 1"]),
    (3, dict(fix={"tp": 3}), ["heads", "not divisible by tp=3", "nearest legal tp: 1"]),
    (8, dict(fix={"tp": 3}), ["tp=3 does not divide the 8 GPUs", "nearest legal tp: 2 or 4"]),
    (16, dict(cluster="a100-80g-dgx", fix={"tp": 16}),
     ["tp=16 spans more than the 8 GPUs of one a100-80g-dgx node", "nearest legal tp: 8"]),
    (6, dict(fix={"cp": 3}), ["sequence length 32 is not divisible by 2·cp = 6",
                              "nearest legal cp: 2"]),
    (8, dict(fix={"mb": 3}), ["mb=3 does not divide the per-replica batch",
                              "nearest legal mb: 2 or 4"]),
    (8, dict(fix={"mb": 3, "dp": 2}), ["mb=3 does not divide the per-replica batch 8",
                                       "nearest legal mb: 2 or 4"]),
    (8, dict(fix={"v": 2, "pp": 1}), ["v=2 stages per rank needs a pipeline, but pp=1",
                                      "nearest legal v: 1"]),
    (8, dict(fix={"v": 3, "pp": 4}), ["pp=4 and v=3 makes 12 stages, more than the 10 layers",
                                      "nearest legal v: 2"]),
    (8, dict(fix={"dp": 2, "tp": 2, "pp": 4}), ["dp=2 × tp=2 × pp=4 = 16 does not divide the 8 GPUs",
                                                "nearest legal pp: 2"]),
    (8, dict(fix={"strategy": "none", "tp": 2}), ["strategy=none leaves tp=2 unused",
                                                  "nearest legal tp: 1"]),
    (8, dict(fix={"strategy": "tp+sp", "dp": 8}), ["strategy=tp+sp splits every block over tp "
                                                   "ranks; tp=1 has none"]),
])
def test_a_fixed_setting_no_configuration_admits_names_the_filter_and_nearest_value(
        gpus, kwargs, words):
    message = refusal(gpus, **kwargs)
    for word in words:
        assert word in message, message


def test_a_tensor_parallel_strategy_fixed_alone_plans_tensor_parallel():
    """strategy=tp without tp: meshes of tp=1, where it would not apply, are not among the
    choices (once it was dropped there without a word); with tp=1 fixed, the plan notes it."""
    chosen = plan(TINY, 8, cluster="cpu-gloo", fix={"strategy": "tp"})[0]
    assert chosen.tp > 1 and all("tp" in s for st in chosen.stages
                                 for layer, s in zip(st.layers, st.strategies)
                                 if layer.startswith("blocks")), chosen.stages
    assert not any("no block is tensor-parallel" in n for n in chosen.notes), chosen.notes
    # with tp=1 fixed too (one --fix swept over meshes), the plan says where it applies
    chosen = plan(TINY, 8, cluster="cpu-gloo", fix={"strategy": "tp+full", "tp": 1})[0]
    assert "strategy=tp+full at tp=1: no block is tensor-parallel; its recompute (full) " \
        "applies" in chosen.notes, chosen.notes


def test_a_gpu_count_nothing_factorises_names_the_nearest_counts_that_plan():
    message = refusal(13)
    assert "13 GPUs: no factorisation into dp × tp × pp × cp fits" in message
    assert "nearest GPU counts that plan: 12 or 14" in message
    for gpus in (12, 14):
        assert plan(TINY, gpus, cluster="cpu-gloo")


@pytest.mark.parametrize("fix, words", [
    ({"v": 2, "schedule": "1f1b"}, ["v=2", "interleaved-1f1b", "'1f1b' runs one stage per rank"]),
    ({"schedule": "pipedream"}, ["unknown schedule 'pipedream'", "1f1b, gpipe, interleaved-1f1b"]),
    ({"zz": 1}, ["unknown fixed setting 'zz'", "dp, tp, pp"]),
    ({"tp": 0}, ["tp must be a positive integer", "got 0"]),
    ({"pp": -2}, ["pp must be a positive integer"]),
    ({"mb": "2"}, ["mb must be a positive integer", "got '2'"]),
    ({"strategy": "tp", "recompute": "full"}, ["contradicts recompute=full", "strategy=tp+full"]),
    ({"recompute": "some"}, ["recompute must be one of none, selective, full"]),
    ({"split_backward": "lazy"}, ["split_backward must be one of retraverse, record"]),
    ({"split_backward": "record", "schedule": "1f1b"}, ["needs schedule=zb-h1"]),
    ({"split_backward": "record", "recompute": "full"}, ["fix recompute=none",
                                                         "split_backward=retraverse"]),
])
def test_fixed_settings_the_runtime_or_the_search_would_refuse_are_refused_before_planning(
        fix, words):
    with pytest.raises(ValueError) as err:
        plan(TINY, 8, cluster="cpu-gloo", fix=fix)
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize("fix", [{"v": 2}, {"schedule": "interleaved-1f1b"}])
def test_interleaving_asked_for_by_v_or_by_name_plans_what_the_runtime_runs(fix):
    from runtime.pipeline.generators import make_schedule
    chosen = plan(TINY, 8, cluster="cpu-gloo", fix=fix)[0]
    assert (chosen.schedule, chosen.virtual_stages) == ("interleaved-1f1b", 2)
    make_schedule(chosen.schedule, chosen.pp, chosen.num_microbatches, chosen.virtual_stages)


def test_memory_limits_are_gib_and_printed_with_the_digits_that_matter():
    from planner.search.plan import gib
    message = refusal(8, memory_limit=0.001)
    assert "no plan fits in 0.0010 GiB per device" in message
    need = float(message.split("needs is ")[1].split(" GiB")[0])
    assert 0.001 < need < 0.01, message
    assert plan(TINY, 8, cluster="cpu-gloo", memory_limit=need)  # rounded up: it is enough
    with pytest.raises(ValueError, match="positive number of GiB"):
        plan(TINY, 8, cluster="cpu-gloo", memory_limit=-1)
    assert (gib(0.0017 * GiB), gib(80 * GiB), gib(0.00171 * GiB, up=True)) == \
        ("0.0017", "80.00", "0.0018")


def test_identical_requests_give_identical_plans_but_for_timing():
    a, b = (plan("gpt2-small", 16, cluster="a100-80g-dgx")[0] for _ in range(2))
    assert a == b and a.dumps(timing=False) == b.dumps(timing=False)
    assert set(a.timing) == {"solve_s", "search_s"} and "s" not in a.solver.split(", ")[-1]
    assert a.dumps().startswith(a.dumps(timing=False)[:-2])  # timing is the last key
    slower = Plan.from_json({**a.to_json(), "timing": {"solve_s": 99.0, "search_s": 99.0}})
    assert slower == a and slower.dumps(timing=False) == a.dumps(timing=False)
    assert "99.00 s" in str(slower)


def test_plans_written_with_the_seconds_in_the_solver_field_still_load():
    chosen = plan(TINY, 2, cluster="cpu-gloo")[0]
    old = {**chosen.to_json(timing=False), "solver": f"{chosen.solver}, 0.04 s"}
    again = Plan.from_json(old)
    assert again == chosen and again.timing == {"solve_s": 0.04}


def test_every_configuration_the_search_considers_is_one_the_runtime_builds():
    import math

    from cost_model.hardware.cluster import get_cluster
    from planner.api import _model_costs
    from planner.search.meshes import Request, configurations
    from runtime.pipeline.generators import schedule_error

    costs, name, batch, seq = _model_costs(TINY, None, None, None)
    for fix in ({}, {"v": 3}, {"schedule": "gpipe"}, {"schedule": "interleaved-1f1b"}):
        req = Request(8, get_cluster("cpu-gloo"), batch, seq, math.inf, name, fix)
        found = list(configurations(costs, req))
        assert found
        for c in found:
            assert schedule_error(c.schedule, c.pp, c.microbatches, c.v) is None, c


def test_a_recorded_split_backward_is_priced_and_carried_to_the_trainer():
    """split_backward=record: no second traversal (a faster step), the recorded gradients on
    every rank but the first (more memory there), and the plan says so; the trainer refuses a
    form the plan did not price."""
    from planner.api import _split_backward
    from runtime.training.trainer import TrainOptions
    fix = {"pp": 2, "schedule": "zb-h1", "mb": 1}
    walked = plan(TINY, 2, cluster="cpu-gloo", fix={**fix, "split_backward": "retraverse"})[0]
    recorded = plan(TINY, 2, cluster="cpu-gloo", fix={**fix, "split_backward": "record"})[0]
    assert (walked.split_backward, recorded.split_backward) == ("", "record")
    # unfixed, the search keeps the faster form that fits: recording, unless its records do not
    assert plan(TINY, 2, cluster="cpu-gloo", fix=fix)[0] == recorded
    between = (walked.predicted.peak_memory_bytes + recorded.predicted.peak_memory_bytes) / 2
    tight = plan(TINY, 2, cluster="cpu-gloo", fix=fix, memory_limit=between / 2**30)[0]
    assert tight.split_backward == "" and tight.predicted.peak_memory_bytes <= between
    assert "split backward: record" in str(recorded)
    assert recorded.predicted.iteration_s < walked.predicted.iteration_s
    first, last = (sum(r) for r in walked.predicted.rank_memory)
    assert sum(recorded.predicted.rank_memory[0]) == pytest.approx(first)
    assert sum(recorded.predicted.rank_memory[1]) > last * 1.05
    assert Plan.from_json(recorded.dumps()) == recorded
    assert _split_backward(recorded, TrainOptions()) == "record"
    with pytest.raises(ValueError, match="plan with --fix split_backward=retraverse"):
        _split_backward(recorded, TrainOptions(split_backward="retraverse"))


def test_autocast_is_priced_and_refused_where_it_cannot_be():
    """autocast="bf16": the same static bytes, the activations as autocast saves them (less at
    one micro-batch in flight than fp32's), the header says it and the trainer runs it; a
    16-bit model or an unknown name is refused."""
    import torch

    from planner.api import _precision
    from runtime.training.trainer import TrainOptions
    fp32 = plan(TINY, 2, cluster="cpu-gloo", fix={"dp": 2})[0]
    cast = plan(TINY, 2, cluster="cpu-gloo", fix={"dp": 2}, autocast="bf16")[0]
    assert (fp32.autocast, cast.autocast) == ("", "bf16")
    assert "autocast bf16 over fp32 weights" in str(cast)
    assert cast.predicted.rank_memory[0][:3] == fp32.predicted.rank_memory[0][:3]
    assert cast.stages[0].activation_bytes < 0.9 * fp32.stages[0].activation_bytes
    assert _precision(cast, TrainOptions()) == "bf16"
    with pytest.raises(ValueError, match="priced under autocast bf16"):
        _precision(cast, TrainOptions(precision="fp32"))
    with pytest.warns(UserWarning, match="plan with autocast='bf16'"):
        assert _precision(fp32, TrainOptions(precision="bf16")) == "bf16"
    with pytest.raises(ValueError, match="give one of bf16, fp16"):
        plan(TINY, 2, cluster="cpu-gloo", autocast="int8")
    from planner.models.presets import build_model, example_batch, get_config
    cfg = get_config(TINY)
    model = build_model(cfg).to(torch.bfloat16)
    with pytest.raises(ValueError, match="leave autocast out"):
        plan(model, 2, example_batch(cfg, 16), cluster="cpu-gloo", autocast="bf16")
