"""Expert parallelism both ways: `--emit megatron|torchtitan` states a plan's ep
(--expert-model-parallel-size, expert_parallel_degree) and reading it back prices the very plan;
what a target cannot state is planned among what it can; the imports read ep and its expert
tensor parallelism, refuse in one line what the framework refuses or fxpar cannot price, and
say what they do not price. Mixtral-tiny on 8 H100s plans in seconds."""
import functools
import re

import pytest

from planner.api import plan as fxpar_plan
from planner.cli import main
from planner.interop.configuration import Configuration, Pricer
from planner.interop.emit import facts_of_config
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.interop.megatron_model import emitted_flags
from planner.interop.round_trip import emit_checked, read
from planner.models.presets import get_config

EXACT = "expressed exactly: read back, it prices this very plan"
NEAREST = re.compile(r"# fxpar plan: [\d.e+-]+ s/iteration; nearest (?:torchtitan|Megatron-LM) "
                     r"configuration: ([\d.e+-]+) s/iteration")
MOE = facts_of_config(get_config("mixtral-tiny"))      # 8 experts, top-2
DENSE = facts_of_config(get_config("llama-tiny"))


@functools.lru_cache(maxsize=None)
def _pricer(runtime: str) -> Pricer:
    return Pricer(get_config("mixtral-tiny"), 8, cluster="h100-sxm-dgx", runtime=runtime)


def _round_trip(target: str, fix: dict):
    """(plan, emitted text, the configuration read back, its price) for fxpar's plan under
    `fix`, as `fxpar plan --emit` runs it."""
    pricer = _pricer(target)
    plan = pricer.best(fix=fix)[0]
    text, table = emit_checked(target, plan, pricer, MOE, csv_path="schedule.csv", fix=fix)
    config = read(target, text, pricer, MOE, table, "schedule.csv").config
    return plan, text, config, pricer.price(config)


# ------------------------------------------------------------------------ 1. round trips
@pytest.mark.parametrize("target, fix, line", [
    ("megatron", {"ep": 4, "tp": 1, "pp": 1, "zero": 1}, "--expert-model-parallel-size 4 \\"),
    ("torchtitan", {"ep": 4, "tp": 1, "zero": 3}, "expert_parallel_degree = 4  #"),
])
def test_an_ep_plan_reads_back_as_the_very_plan(target, fix, line):
    plan, text, config, priced = _round_trip(target, fix)
    assert plan.ep == 4 and EXACT in text, text
    assert any(written.startswith(line) for written in text.splitlines())
    assert config == Configuration.of(plan) and config.ep == 4
    assert priced.plan.ep == 4
    assert priced.iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-12)


def test_the_search_an_emit_runs_is_fxpar_plan_s():
    """--emit states the plan `fxpar plan` prints: every ep searched, not ep=1 alone."""
    ours = _pricer("megatron").best()[0]
    planned = fxpar_plan(get_config("mixtral-tiny"), 8, cluster="h100-sxm-dgx",
                         runtime="megatron")[0]
    assert (ours.ep, ours.predicted) == (planned.ep, planned.predicted)


def test_cli_emits_a_fixed_ep_and_prices_it_back(capsys):
    base = ["plan", "--model", "mixtral-tiny", "--gpus", "8", "--cluster", "h100-sxm-dgx",
            "--fix", "ep=2,tp=1,pp=1,zero=0"]
    assert main(base + ["--emit", "megatron"]) == 0
    flags = capsys.readouterr().out
    assert EXACT in flags and "--expert-model-parallel-size 2 \\" in flags.splitlines()
    assert main(base + ["--from-megatron", flags]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM configuration: dp=8 tp=1 pp=1 cp=1 ep=2," in out
    assert "fxpar's plan is this configuration" in out


def test_torchtitan_replicas_lend_no_rank_to_ep_nearest_fsdp():
    plan, text, config, priced = _round_trip("torchtitan", {"ep": 2, "tp": 1, "zero": 0, "pp": 1})
    assert (plan.ep, plan.zero) == (2, 0)
    assert "torchtitan carves expert_parallel_degree 2 out of FSDP's shard ranks" in text
    assert (config.ep, config.zero) == (2, 3)
    assert priced.iteration_s == pytest.approx(float(NEAREST.search(text).group(1)), rel=2e-3)


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_ep_beside_tp_is_planned_among_what_the_target_states(target):
    """fxpar keeps experts whole on every tp rank; neither framework runs that at ep > 1: the
    emit plans without tp (or without ep) and says why."""
    plan, text, config, priced = _round_trip(target, {"ep": 2, "tp": 2})
    assert (plan.ep, plan.tp) == (2, 2)
    assert "fxpar keeps every expert whole on each of the tp=2 ranks" in text
    assert "expert parallelism without tp" in text
    assert config.ep == 1 or config.tp == 1
    assert priced.iteration_s == pytest.approx(float(NEAREST.search(text).group(1)), rel=2e-3)


def test_megatron_keeps_experts_whole_over_tp_as_fxpar_prices_them():
    """At ep=1 and tp > 1 Megatron-LM would split each expert over tp by default: the export
    says --expert-tensor-parallel-size 1, which reads back without a note."""
    _, text, config, _ = _round_trip("megatron", {"ep": 1, "tp": 2, "pp": 1, "strategy": "tp"})
    assert "--expert-tensor-parallel-size 1 \\" in text.splitlines()
    assert (config.tp, config.ep) == (2, 1)
    imported = megatron_configuration(text, MOE, 8)
    assert not any("expert" in note for note in imported.notes)


# ------------------------------------------------------------------------ 2. refusals
def _megatron(extra: str, facts=MOE, gpus: int = 8):
    text = (" ".join(emitted_flags(facts, facts.seq)[0]) + " --micro-batch-size 1 "
            "--global-batch-size 16 " + extra)
    return megatron_configuration(text, facts, gpus)


def _megatron_refusal(extra: str, facts=MOE, gpus: int = 8) -> str:
    with pytest.raises(ValueError) as err:
        _megatron(extra, facts, gpus)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("extra, gpus, message", [
    ("--expert-model-parallel-size 3", 8, "--expert-model-parallel-size 3 does not divide the "
     "model's 8 experts: give --expert-model-parallel-size one of 1, 2, 4, 8"),
    ("--expert-model-parallel-size 2 --expert-tensor-parallel-size 2", 8,
     "--expert-tensor-parallel-size 2 splits each expert over 2 ranks; fxpar prices experts "
     "whole on every rank: give --expert-tensor-parallel-size 1"),
    ("--expert-model-parallel-size 8 --context-parallel-size 2", 4,
     "--expert-model-parallel-size 8 does not divide data parallel 2 x context parallel 2 = 4 "
     "(Megatron-LM carves the expert-parallel ranks out of them): give a divisor of 4"),
])
def test_megatron_refusals_name_the_flag_and_what_to_give(extra, gpus, message):
    assert _megatron_refusal(extra, gpus=gpus) == message


def test_megatron_refuses_ep_at_tp_and_ep_without_experts():
    said = _megatron_refusal("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                             "--sequence-parallel --expert-tensor-parallel-size 1")
    assert said.startswith("--expert-model-parallel-size 2 at --tensor-model-parallel-size 2: "
                           "Megatron-LM runs experts at tp > 1 sequence-parallel")
    assert said.endswith("give --tensor-model-parallel-size 1 or --expert-model-parallel-size 1")
    assert _megatron_refusal("--expert-model-parallel-size 2", DENSE) == (
        "--expert-model-parallel-size 2 needs experts (--num-experts); the model has none: give "
        "--expert-model-parallel-size 1")


def _toml(tmp_path, parallelism: str, facts=MOE, gpus: int = 8):
    path = tmp_path / "job.toml"
    path.write_text(f"[parallelism]\n{parallelism}\n[activation_checkpoint]\nmode = \"none\"\n"
                    f"[training]\nlocal_batch_size = 2\nseq_len = {facts.seq}\n")
    return torchtitan_configuration(str(path), facts, gpus)


def _toml_refusal(tmp_path, parallelism: str, facts=MOE) -> str:
    with pytest.raises(ValueError) as err:
        _toml(tmp_path, parallelism, facts)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("parallelism, message", [
    ("data_parallel_shard_degree = 8\nexpert_parallel_degree = 3",
     "[parallelism] expert_parallel_degree = 3: torchtitan borrows it from "
     "context_parallel_degree 1 (all of it) and data_parallel_shard_degree 8: give a multiple "
     "of 1 that divides 8"),
    ("data_parallel_replicate_degree = 8\ndata_parallel_shard_degree = 1\n"
     "expert_parallel_degree = 2",
     "[parallelism] expert_parallel_degree = 2: torchtitan borrows it from "
     "context_parallel_degree 1 (all of it) and data_parallel_shard_degree 1: give a multiple "
     "of 1 that divides 1"),
    ("data_parallel_shard_degree = 4\ntensor_parallel_degree = 2\nexpert_parallel_degree = 2\n"
     "expert_tensor_parallel_degree = 4",
     "[parallelism] expert_tensor_parallel_degree = 4: torchtitan takes 1 or "
     "tensor_parallel_degree (2)"),
])
def test_torchtitan_refusals_name_the_field_and_what_to_give(tmp_path, parallelism, message):
    assert _toml_refusal(tmp_path, parallelism) == message


def test_torchtitan_refuses_ep_at_tp_an_ep_short_of_cp_and_odd_experts(tmp_path):
    said = _toml_refusal(tmp_path, "data_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n"
                                   "expert_parallel_degree = 2")
    assert said.startswith("[parallelism] expert_parallel_degree = 2 at tensor_parallel_degree "
                           "= 2: torchtitan splits each expert over the tp ranks")
    assert said.endswith("give tensor_parallel_degree = 1 or expert_parallel_degree = 1")
    assert "(all of it)" in _toml_refusal(
        tmp_path, "data_parallel_shard_degree = 2\ncontext_parallel_degree = 4\n"
                  "expert_parallel_degree = 2")
    assert _toml(tmp_path, "data_parallel_shard_degree = 2\ncontext_parallel_degree = 4\n"
                           "expert_parallel_degree = 4").config.ep == 4


# ------------------------------------------------------------------------ 3. nothing ignored
def test_expert_flags_are_read_or_said_never_dropped(tmp_path):
    # Megatron-LM's default splits experts over tp: said, and priced whole as fxpar runs them
    tp = _megatron("--tensor-model-parallel-size 2")
    assert any("without --expert-tensor-parallel-size Megatron-LM splits each expert" in n
               for n in tp.notes)
    assert not any("expert" in note for note in _megatron(
        "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1").notes)
    assert _megatron("--expert-model-parallel-size 4").config.ep == 4
    assert any("--expert-tensor-parallel-size 2: no effect on a model without experts" in n
               for n in _megatron("--expert-tensor-parallel-size 2", DENSE).notes)
    # torchtitan: etp at ep=1, and ep for a dense model, have no effect there: said so
    imp = _toml(tmp_path, "data_parallel_shard_degree = 8\nexpert_tensor_parallel_degree = 2")
    assert imp.config.ep == 1 and any("no effect at expert_parallel_degree = 1" in n
                                      for n in imp.notes)
    dense = _toml(tmp_path, "data_parallel_shard_degree = 8\nexpert_parallel_degree = 2", DENSE)
    assert dense.config.ep == 1 and any("no effect on a model without experts" in n
                                        for n in dense.notes)
    assert not any("expert" in name for name in dense.ignored)


def test_moe_imbalance_prices_the_emitted_plan_too(capsys):
    """--moe-imbalance reaches the emit's plan and prices, as it reaches `fxpar plan`'s."""
    args = ["plan", "--model", "mixtral-tiny", "--gpus", "8", "--cluster", "h100-sxm-dgx",
            "--runtime", "megatron", "--fix", "ep=4,tp=1,pp=1,zero=1", "--moe-imbalance", "2"]
    assert main(args + ["--json"]) == 0
    planned = re.search(r'"iteration_s": ([\d.e+-]+)', capsys.readouterr().out).group(1)
    assert main(args + ["--emit", "megatron"]) == 0
    text = capsys.readouterr().out
    assert EXACT in text and f"# fxpar plan: {float(planned):.4g} s/iteration" in text
