"""Expert parallelism on real gloo ranks against one process: losses of every step, every
gradient and the final parameters (rtol 1e-5), for EP carved from dp (x pp, x tp x pp) and from
dp x cp, with the balance loss's statistics summed over the cp group; and the all-to-all and
all-reduce bytes the runtime counts against cost_model's formulas for the routing that ran."""
import dataclasses

import pytest
import torch
from conftest import rank_pool

from planner.api import plan
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import assert_same_run, reference_run, run_parallel

STEPS = 2
MIXTRAL = get_config("mixtral-tiny").with_(layers=2, global_batch=8)
DEEPSEEK = get_config("deepseek-tiny").with_(layers=3, global_batch=8)


def _plan(config, gpus, ep, dp, tp=1, pp=1, schedule="1f1b", zero=0, cp=1):
    """A plan fixed but for ep (captured from the whole model: dense and MoE blocks)."""
    per_replica = config.global_batch // dp
    fix = {"dp": dp, "tp": tp, "pp": pp, "mb": 1 if pp > 1 else min(2, per_replica),
           "schedule": schedule, "zero": zero, "cp": cp}
    if tp > 1:
        fix["strategy"] = "tp"
    model, batch = build_model(config), example_batch(config, config.global_batch)
    return dataclasses.replace(plan(model, gpus, batch, cluster="cpu-gloo", fix=fix)[0], ep=ep)


CASES = [  # (config, gpus, ep, dp, tp, pp, schedule, zero)
    pytest.param(MIXTRAL, 4, 2, 4, 1, 1, "1f1b", 0, id="ep2-of-dp4"),
    pytest.param(MIXTRAL, 4, 4, 4, 1, 1, "1f1b", 0, id="ep4"),
    pytest.param(MIXTRAL, 4, 2, 2, 1, 2, "zb-h1", 0, id="ep2-pp2-zb"),
    pytest.param(MIXTRAL, 4, 2, 4, 1, 1, "1f1b", 3, id="ep2-of-zero3-dp4"),
    pytest.param(DEEPSEEK, 8, 2, 2, 2, 2, "1f1b", 1, id="ep2-tp2-pp2-zero1-deepseek"),
    pytest.param(DEEPSEEK, 8, 8, 8, 1, 1, "1f1b", 0, id="ep8-deepseek"),
]


@pytest.mark.dist
@pytest.mark.parametrize("config,gpus,ep,dp,tp,pp,schedule,zero", CASES)
def test_expert_parallel_matches_one_process(config, gpus, ep, dp, tp, pp, schedule, zero):
    chosen = _plan(config, gpus, ep, dp, tp, pp, schedule, zero)
    assert (chosen.ep, chosen.zero) == (ep, zero)
    parallel = run_parallel(config, chosen, STEPS, rank_pool(gpus))
    assert_same_run(parallel, reference_run(config, STEPS))


# The balance loss at 25x its preset weight, so that a wrong share of its gradient shows.
BALANCED = MIXTRAL.with_(aux_loss=0.5)
CP_CASES = [  # (config, gpus, ep, dp, cp, pp, schedule)
    pytest.param(MIXTRAL, 4, 1, 1, 2, 2, "1f1b", id="cp2-pp2"),
    pytest.param(BALANCED, 4, 1, 2, 2, 1, "1f1b", id="cp2-dp2-aux0.5"),
    pytest.param(BALANCED, 4, 2, 1, 2, 2, "zb-h1", id="ep2-of-cp2-pp2-zb"),
    pytest.param(BALANCED, 4, 4, 2, 2, 1, "1f1b", id="ep4-of-dp2-cp2"),
]


@pytest.mark.dist
@pytest.mark.parametrize("config,gpus,ep,dp,cp,pp,schedule", CP_CASES)
def test_balance_loss_under_context_parallel_matches_one_process(config, gpus, ep, dp, cp, pp,
                                                                 schedule):
    chosen = _plan(config, gpus, ep, dp, pp=pp, schedule=schedule, cp=cp)
    assert (chosen.ep, chosen.cp, chosen.dp, chosen.pp) == (ep, cp, dp, pp)
    parallel = run_parallel(config, chosen, STEPS, rank_pool(gpus))
    assert_same_run(parallel, reference_run(config, STEPS))


def _traffic_worker(config, plan_json: str):
    """One step; per rank: local expert rows, the all-to-all bytes counted per layer, the slots
    this rank routed to other ranks' experts (from the routing the step used), the all-reduce
    bytes counted per layer and the number of micro-batches."""
    import torch.distributed as dist

    from planner.api import ParallelModel
    from planner.search.plan import Plan
    from planner.training.local import build, make_optimizer
    from runtime.experts import dispatch as experts
    from runtime.comm import instrument

    torch.manual_seed(0)
    model, batch = build(config)
    chosen = Plan.from_json(plan_json)
    pm = ParallelModel(model, chosen, [], batch, make_optimizer)
    trainer = pm.shard()
    remote = {}
    original = experts._expert_parallel

    def spy(sent, counts, got, weights, tag):   # this micro-batch's rows per expert / source
        me, ep, local = dist.get_rank(experts._EP_GROUP[0]), len(got), len(got[0])
        out = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
        back = [sum(row) for row in got]
        remote[tag] = remote.get(tag, 0) + sum(out) - out[me] + sum(back) - back[me]
        return original(sent, counts, got, weights, tag)

    experts._expert_parallel = spy
    with instrument.counting() as traffic:
        trainer.step(*batch)
    experts._expert_parallel = original
    rows = {n: tuple(p.shape) for prog in trainer.programs.values()
            for n, p in prog.gm.named_parameters() if experts.is_expert(p)}
    sent = {tag: b for (kind, tag), b in traffic.sent.items() if kind == "all_to_all"}
    reduced = {tag: b for (kind, tag), b in traffic.sent.items() if kind == "all_reduce"}
    return rows, sent, remote, reduced, trainer.schedule.num_microbatches


@pytest.mark.dist
@pytest.mark.parametrize("ep,dp,pp,schedule", [(4, 4, 1, "1f1b"), (2, 2, 2, "zb-h1")],
                         ids=["ep4", "ep2-pp2-zb"])  # zb-h1: a split backward, exchanged once
def test_all_to_all_bytes_counted_as_priced(pool4, ep, dp, pp, schedule):
    from cost_model.ops.moe import MoEFacts
    chosen = _plan(MIXTRAL, 4, ep, dp, pp=pp, schedule=schedule)
    results = pool4.run(_traffic_worker, MIXTRAL, chosen.dumps())
    e, f, h = MIXTRAL.experts, MIXTRAL.expert_ffn, MIXTRAL.hidden
    layers = set()
    for rows, sent, remote, _, _ in results:
        assert rows and all(shape[0] == e // ep for shape in rows.values())
        assert sent.keys() == remote.keys() and sent
        layers |= sent.keys()
        for layer, slots in remote.items():
            # cost_model.ops.moe: 4 T k h d r per micro-batch, T k r the slots a rank sends away,
            # which routing balances against those it receives: here their mean, slots / 2
            facts = MoEFacts(tokens=slots, hidden=h, experts=e, top_k=1, ffn=f, dtype_bytes=4)
            assert sent[layer] == facts.all_to_all_bytes(4, remote=0.5)
    assert layers == {"blocks.0", "blocks.1"}


@pytest.mark.dist
def test_balance_all_reduce_and_all_to_all_under_cp_counted_as_priced(pool4):
    """ep=2 carved from cp=2, pp=2, ZB-H1 (a split backward sums the statistics' gradient once):
    each MoE layer's balance statistics (2 b E values per micro-batch of b sequences) are
    all-reduced forward and backward, the bytes layer_cost.price adds under cp; the all-to-all
    moves the rank's seq / cp tokens."""
    from cost_model.hardware.cluster import get_cluster
    from cost_model.hardware.comm import bytes_on_wire
    from cost_model.layers.layer_cost import price, profile_layer
    from cost_model.ops.moe import MoEFacts
    from cost_model.layers.strategy import Strategy
    from passes.capture.trace import capture

    cp, mb = 2, 1
    chosen = _plan(BALANCED, 4, 2, 1, pp=2, schedule="zb-h1", cp=cp)
    assert (chosen.cp, chosen.ep, chosen.micro_batch) == (cp, 2, mb)
    captured = capture(build_model(BALANCED), tuple(x[:mb] for x in example_batch(BALANCED, mb)))
    e, f, h = BALANCED.experts, BALANCED.expert_ffn, BALANCED.hidden
    priced = {}
    for block in captured.blocks:
        cost = price(profile_layer(captured, block), Strategy(), mb, get_cluster("cpu-gloo"), 1, cp)
        priced[block.name] = dict(cost.comm_bytes)["all_reduce"]
        assert priced[block.name] == 2 * bytes_on_wire("all_reduce", mb * 2 * e * 4, cp)
    layers = set()
    for rows, sent, remote, reduced, micro in pool4.run(_traffic_worker, BALANCED, chosen.dumps()):
        assert reduced and all(reduced[layer] == micro * priced[layer] for layer in reduced)
        layers |= reduced.keys()
        for layer, slots in remote.items():
            facts = MoEFacts(tokens=slots, hidden=h, experts=e, top_k=1, ffn=f, dtype_bytes=4)
            assert sent[layer] == facts.all_to_all_bytes(4, remote=0.5)
    assert layers == {"blocks.0", "blocks.1"}


@pytest.mark.dist
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])  # deepseek_v3: latent attention,
def test_hugging_face_moe_ep2_pp2_matches_one_process(pool4, arch):  # a dense first block,
    pytest.importorskip("transformers")  # group-limited sigmoid routing, a shared expert
    from planner.models.hf_moe import HFMoESpec
    spec = HFMoESpec(arch)
    model, batch = spec.build()
    fix = {"dp": 2, "tp": 1, "pp": 2, "mb": 1, "schedule": "1f1b", "ep": 2}
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    assert (chosen.ep, chosen.pp, chosen.dp) == (2, 2, 2)
    assert_same_run(run_parallel(spec, chosen, STEPS, pool4), reference_run(spec, STEPS))


@pytest.mark.dist
def test_hugging_face_moe_tp2_ep2_matches_one_process(pool4):
    """Mixtral's router under tensor parallelism: its softmax over the experts reads the
    router's output whole, so the router is cut by output features and all-gathered, attention
    is column- and row-parallel, the experts are spread over ep."""
    pytest.importorskip("transformers")
    from planner.models.hf_moe import HFMoESpec
    spec = HFMoESpec("mixtral")
    model, batch = spec.build()
    fix = {"dp": 2, "tp": 2, "pp": 1, "ep": 2, "strategy": "tp"}
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    assert (chosen.tp, chosen.ep, chosen.dp) == (2, 2, 2)
    assert "tp" in chosen.stages[0].strategies
    assert_same_run(run_parallel(spec, chosen, STEPS, pool4), reference_run(spec, STEPS))


GPT_OSS_TINY = (("hidden_size", 32), ("intermediate_size", 48), ("num_local_experts", 4),
                ("num_experts_per_tok", 2), ("num_hidden_layers", 2), ("num_attention_heads", 4),
                ("num_key_value_heads", 2), ("head_dim", 8))


@pytest.mark.dist
def test_gpt_oss_experts_ep2_match_one_process(pool2):  # biased, interleaved, clamped experts:
    pytest.importorskip("transformers")  # their biases cut along E with their weights
    from planner.models.hf_moe import HFMoESpec
    spec = HFMoESpec("gpt_oss", overrides=GPT_OSS_TINY)
    model, batch = spec.build()
    fix = {"dp": 2, "tp": 1, "pp": 1, "mb": 2, "schedule": "1f1b", "ep": 2}
    chosen = plan(model, 2, batch, cluster="cpu-gloo", fix=fix)[0]
    assert (chosen.ep, chosen.dp) == (2, 2)
    assert_same_run(run_parallel(spec, chosen, STEPS, pool2), reference_run(spec, STEPS))
