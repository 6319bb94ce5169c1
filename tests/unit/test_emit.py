"""Plans that travel: `--emit torchtitan|megatron` and `--from-megatron` / `--from-torchtitan`.

The names were checked against these versions of the projects' sources:

* torchtitan `torchtitan/config/job_config.py` at 000204a4a8bf3d0f31adc44fc29855fbb6ea13d8 (the
  TOML `[parallelism]` fields data_parallel_replicate_degree, data_parallel_shard_degree,
  tensor_parallel_degree, pipeline_parallel_degree, context_parallel_degree,
  pipeline_parallel_schedule, pipeline_parallel_schedule_csv, pipeline_parallel_split_points,
  pipeline_parallel_microbatch_size, disable_loss_parallel; `[activation_checkpoint]` mode and
  selective_ac_option; `[training]` local_batch_size, global_batch_size, seq_len), and
  `torchtitan/distributed/pipeline_parallel.py` at 02ef790c79614758f85880e173d2338d7de502a3 (a
  schedule CSV runs as `_PipelineScheduleRuntime._load_csv`; pipeline_parallel_schedule still
  says whether a rank holds one stage). torchtitan PR #1416 (July 2025) deprecated the split
  points in favour of module_fqns_per_model_part, which the import reads too.
* torch.distributed.pipelining `schedules.py` of torch 2.13: get_schedule_class's names (1F1B,
  GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV,
  PipelineScheduleSingle, PipelineScheduleMulti: none is ZB-H1) and the action regex
  `(\\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\\d*)`: stage, kind,
  micro-batch, the same order as fxpar's "2F0".
* Megatron-LM `megatron/training/arguments.py` at 000c4ac24f61159c138b0975def722c65245983c and
  `megatron/core/transformer/pipeline_parallel_layer_layout.py` at
  00caa53af30912914981c86f39db123961678bbd (the layout string "Et*5|(t*6|)*14t*5L").
"""
import math
import re
import tomllib
from dataclasses import replace

import pytest

from planner.cli import main
from planner.interop.emit import emit, facts_of_config, nearest, schedule_csv
from planner.interop.round_trip import emit_checked
from planner.interop.from_megatron import megatron_configuration, parse_layout, read_megatron_flags
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.models.presets import get_config
from planner.interop.configuration import Configuration, Pricer, block_strategies

PRICED = re.compile(r"# fxpar plan: ([\d.]+) s/iteration; nearest (torchtitan|Megatron-LM) "
                    r"configuration: ([\d.]+) s/iteration")


@pytest.fixture(scope="module")
def gpt3():
    pricer = Pricer(get_config("gpt3-175b"), 1024, cluster="a100-80g-dgx")
    # a zb-h1 plan with context parallelism: the schedule torchtitan reads from a CSV
    fix = {"tp": 4, "pp": 16, "cp": 2, "zero": 0, "schedule": "zb-h1", "strategy": "tp",
           "split_backward": "retraverse"}
    return pricer, pricer.best(fix=fix)[0], facts_of_config(get_config("gpt3-175b"))


@pytest.fixture(scope="module")
def llama70():
    pricer = Pricer(get_config("llama2-70b"), 64, cluster="h100-sxm-dgx")
    return (pricer, pricer.best(fix={"schedule": "zb-h1", "zero": 0,
                                     "split_backward": "retraverse"})[0],
            facts_of_config(get_config("llama2-70b")))


def _flags(text: str) -> dict:
    return read_megatron_flags(text)[0]


def _boundaries(plan) -> list[str]:
    firsts, first = [], 0
    for stage in block_strategies(plan)[:-1]:
        first += len(stage)
        firsts.append(f"layers.{first}")
    return firsts


@pytest.mark.parametrize("case", ["gpt3", "llama70"])
def test_torchtitan_export_field_by_field(case, request, tmp_path):
    pricer, plan, _ = request.getfixturevalue(case)
    csv_path = str(tmp_path / "schedule.csv")
    text, table = emit("torchtitan", plan, lambda: pricer, csv_path=csv_path)
    data = tomllib.loads(text)
    par = data["parallelism"]
    assert plan.schedule == "zb-h1" and plan.cp == 2  # both plans: zb-h1 with context parallel
    assert par["data_parallel_replicate_degree"] == plan.dp
    assert par["data_parallel_shard_degree"] == 1
    assert par["tensor_parallel_degree"] == plan.tp
    assert par["pipeline_parallel_degree"] == plan.pp
    assert par["context_parallel_degree"] == plan.cp
    assert par["disable_loss_parallel"] is False  # both plans split the ends over the vocabulary
    assert {s for st in plan.stages for l, s in zip(st.layers, st.strategies)
            if l in ("embed", "head")} == {"vocab-tp"}
    # ZB-H1 has no torch class: a single-stage runtime schedule read from the CSV
    assert par["pipeline_parallel_schedule"] == "PipelineScheduleSingle"
    assert par["pipeline_parallel_schedule_csv"] == csv_path
    assert table == schedule_csv("zb-h1", plan.pp, plan.num_microbatches)
    assert par["pipeline_parallel_microbatch_size"] == plan.micro_batch
    assert par["pipeline_parallel_split_points"] == _boundaries(plan)
    assert data["activation_checkpoint"] == {"mode": "none"}
    assert all("full" not in s and "sel" not in s for st in block_strategies(plan) for s in st)
    assert data["training"] == {"local_batch_size": plan.global_batch // plan.dp,
                                "global_batch_size": plan.global_batch, "seq_len": plan.seq}
    # fxpar's blocks are "tp"; torchtitan's tensor parallelism is always sequence-parallel
    assert {s for st in block_strategies(plan) for s in st} == {"tp"}
    assert "not expressible: torchtitan's tensor parallelism is always sequence-parallel" in text
    ours, label, theirs = PRICED.search(text).groups()
    assert float(ours) == pytest.approx(plan.predicted.iteration_s, rel=1e-3)
    # torch.distributed.pipelining's I and W record the gradients at joins: fxpar's record form,
    # not the walk both plans were fixed to
    assert "not expressible: torchtitan's pipelining splits the backward by recording" in text
    # and with cp=2 torchtitan's FSDP mesh takes the cp ranks in: replicas over dp, FSDP over cp
    assert "over the 2 context-parallel ranks whatever the data-parallel degrees" in text
    sp = pricer.price(replace(Configuration.of(plan), split_backward="record", zero=3,
                              dp_shard=1, stages=tuple(tuple("tp+sp" for _ in st)
                                                       for st in block_strategies(plan))))
    assert float(theirs) == pytest.approx(sp.iteration_s, rel=1e-3) and label == "torchtitan"


@pytest.mark.parametrize("case", ["gpt3", "llama70"])
def test_megatron_export_field_by_field(case, request):
    pricer, plan, facts = request.getfixturevalue(case)
    text, table = emit("megatron", plan, lambda: pricer, facts)
    assert table is None
    flags = _flags(text)
    assert flags["--tensor-model-parallel-size"] == plan.tp
    assert flags["--pipeline-model-parallel-size"] == plan.pp
    assert flags["--context-parallel-size"] == plan.cp
    assert flags["--micro-batch-size"] == plan.micro_batch
    assert flags["--global-batch-size"] == plan.global_batch
    lengths = {len(st) for st in block_strategies(plan)}
    assert lengths == {facts.layers // plan.pp}  # even stages: no layout flag needed
    assert not any(k.startswith(("--pipeline-model-parallel-layout", "--num-layers-per-virtual",
                                 "--recompute", "--sequence-parallel",
                                 "--use-distributed-optimizer")) for k in flags)
    assert (flags["--num-layers"], flags["--hidden-size"], flags["--num-attention-heads"],
            flags["--ffn-hidden-size"], flags["--seq-length"], flags["--vocab-size"]) == (
        facts.layers, facts.hidden, facts.heads, facts.ffn, plan.seq, facts.vocab)
    assert ("--num-query-groups" in flags) == (facts.kv_heads != facts.heads)
    assert "--expert-model-parallel-size" not in flags
    # Megatron-LM has no ZB-H1: the nearest is 1F1B on the same stages, priced beside the plan
    assert "not expressible: Megatron-LM has no zb-h1 schedule; nearest: 1f1b" in text
    ours, label, theirs = PRICED.search(text).groups()
    one_f = pricer.price(replace(Configuration.of(plan), schedule="1f1b"))
    assert label == "Megatron-LM"
    assert float(ours) == pytest.approx(plan.predicted.iteration_s, rel=1e-3)
    assert float(theirs) == pytest.approx(one_f.iteration_s, rel=1e-3)


def test_plan_layout_prices_to_the_plan_itself(gpt3):
    pricer, plan, _ = gpt3
    priced = pricer.price(Configuration.of(plan))
    assert priced.fits and priced.plan.predicted == plan.predicted
    assert [st.layers for st in priced.plan.stages] == [st.layers for st in plan.stages]


def test_megatron_round_trip_prices_the_same_configuration(gpt3):
    """emit megatron, read that text back: the same configuration at the same time; when the
    plan is expressible (1F1B fixed), exactly the plan's own time."""
    pricer, plan, facts = gpt3
    expressible = pricer.best(fix={"schedule": "1f1b", "strategy": "tp+sp"})[0]
    text, _ = emit_checked("megatron", expressible, pricer, facts)
    # GPT-3's odd vocabulary of 50257 is padded by one row at tp=2 (the least Megatron-LM can)
    assert "the same parallel plan (read back, it prices this very plan), for the nearest " \
           "model Megatron-LM can state" in text
    assert "pads the vocabulary from 50257 to 50258 rows (a multiple of " \
           "--make-vocab-size-divisible-by 1 x tp 2)" in text
    imported = megatron_configuration(text, facts, 1024)
    assert imported.config == Configuration.of(expressible)
    assert pricer.price(imported.config).plan.predicted == expressible.predicted
    # and the zb-h1 plan: its nearest configuration comes back as priced in the comment
    text, _ = emit("megatron", plan, lambda: pricer, facts)
    again = pricer.price(megatron_configuration(text, facts, 1024).config)
    assert float(PRICED.search(text).group(3)) == pytest.approx(again.iteration_s, rel=1e-3)


def test_round_trips_of_recompute_mixes(tmp_path):
    """A memory-bound plan mixes tp, tp+sp and full recomputation per layer; neither framework
    states that: the nearest (Megatron's block recompute, torchtitan's one layer in n) reads
    back at its printed price."""
    pricer = Pricer(get_config("llama2-70b"), 64, cluster="h100-sxm-dgx", memory_limit=40)
    plan = pricer.best()[0]
    facts = facts_of_config(get_config("llama2-70b"))
    assert len({s for st in block_strategies(plan) for s in st}) > 1
    text, _ = emit("megatron", plan, lambda: pricer, facts)
    assert "--recompute-method" in _flags(text)
    back = pricer.price(megatron_configuration(text, facts, 64).config)
    assert float(PRICED.search(text).group(3)) == pytest.approx(back.iteration_s, rel=1e-3)
    toml, table = emit("torchtitan", plan, lambda: pricer)
    assert table is None  # 1f1b has a class
    (tmp_path / "job.toml").write_text(toml)
    expressed = nearest("torchtitan", plan, lambda: pricer)
    imported = torchtitan_configuration(str(tmp_path / "job.toml"), facts, 64)
    assert imported.config == expressed.config
    assert pricer.price(imported.config).iteration_s == pytest.approx(
        float(PRICED.search(toml).group(3)), rel=1e-3)


def test_cli_round_trip_with_a_layout_and_a_schedule_csv(tmp_path, capsys, monkeypatch):
    """gpt2-xl on 8 GPUs at 12 GiB: uneven stages (a quoted --pipeline-model-parallel-layout)
    and zb-h1 (a CSV beside the TOML), through the command line both ways."""
    monkeypatch.chdir(tmp_path)
    base = ["plan", "--model", "gpt2-xl", "--gpus", "8", "--cluster", "a100-80g-dgx",
            "--memory-limit", "12", "--fix", "pp=4,schedule=zb-h1"]
    assert main(base + ["--emit", "megatron"]) == 0
    flags_text = capsys.readouterr().out
    assert "--pipeline-model-parallel-layout 'E" in flags_text
    layout = _flags(flags_text)["--pipeline-model-parallel-layout"]
    assert sum(parse_layout(layout, 48, 4)) == 48
    assert main(base + ["--from-megatron", flags_text]) == 0
    out = capsys.readouterr().out
    printed = float(PRICED.search(flags_text).group(3))
    assert f"Megatron-LM configuration: {printed:.4g} s/iteration" in out
    # torchtitan shards data parallel with FSDP only: a plan fixed to it round-trips exactly
    base[-1] += ",zero=3"
    assert main(base + ["--emit", "torchtitan"]) == 0
    toml_text = capsys.readouterr().out
    (tmp_path / "job.toml").write_text(toml_text)
    assert (tmp_path / tomllib.loads(toml_text)["parallelism"]
            ["pipeline_parallel_schedule_csv"]).is_file()
    assert main(base + ["--from-torchtitan", str(tmp_path / "job.toml")]) == 0
    out = capsys.readouterr().out
    # the price it was emitted at: the nearest configuration's, or the plan's when exact
    nearest_s = (re.search(r"nearest torchtitan configuration: ([\d.]+) s/iteration", toml_text)
                 or re.search(r"fxpar plan: ([\d.]+) s/iteration", toml_text))
    assert "zb-h1" in out.splitlines()[0]
    assert f"torchtitan configuration: {nearest_s.group(1)} s/iteration" in out  # as emitted
    # torchtitan's I and W record (fxpar's split_backward=record), not through recomputed layers
    assert "split_backward=record" in out.splitlines()[0]
    (tmp_path / "job.toml").write_text(toml_text.replace('mode = "none"', 'mode = "full"'))
    assert main(base + ["--from-torchtitan", str(tmp_path / "job.toml")]) == 0
    out = capsys.readouterr().out
    assert "split_backward" not in out.splitlines()[0] and "recomputation full" in out
    assert "fxpar prices recording only without recomputation" in out


def test_torchtitan_gets_no_more_stages_than_layers(tmp_path, capsys):
    """A 2-layer model whose plan pipelines it over 4 stages: torchtitan's split points name
    each stage's first layer, so it gets at most 2 stages, and what it is given reads back."""
    base = ["plan", "--model", "llama-tiny", "--layers", "2", "--gpus", "16",
            "--cluster", "h100-sxm-dgx", "--fix", "pp=4"]
    assert main(base + ["--emit", "torchtitan"]) == 0
    toml_text = capsys.readouterr().out
    assert "at most 2 pipeline stages" in toml_text
    parallelism = tomllib.loads(toml_text)["parallelism"]
    assert parallelism["pipeline_parallel_degree"] <= 2
    points = parallelism.get("pipeline_parallel_split_points", [])
    assert all(p in ("layers.1",) for p in points)
    (tmp_path / "job.toml").write_text(toml_text)
    assert main(["plan", "--model", "llama-tiny", "--layers", "2", "--gpus", "16",
                 "--cluster", "h100-sxm-dgx", "--from-torchtitan",
                 str(tmp_path / "job.toml")]) == 0
    printed = re.search(r"nearest torchtitan configuration: ([\d.]+) s/iteration", toml_text)
    assert f"torchtitan configuration: {printed.group(1)} s/iteration" in capsys.readouterr().out


def test_schedule_csv_is_what_torch_pipelining_reads():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for name, pp, m, v in [("zb-h1", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("1f1b", 3, 5, 1)]:
        rows = schedule_csv(name, pp, m, v).splitlines()
        actions = {r: [schedules._Action.from_str(a) for a in row.split(",")]
                   for r, row in enumerate(rows)}
        mapping = schedules._validate_schedule(actions, pp, pp * v, m)
        assert mapping == {s: s % pp for s in range(pp * v)}
        lowered = schedules._add_send_recv(actions, stage_to_rank=lambda s: mapping[s],
                                           num_stages=pp * v)
        schedules._simulate_comms_compute(lowered, lambda s: mapping[s], pp * v)  # no deadlock


def test_layout_string_reads_as_megatron_reads_it():
    assert parse_layout("Et*5|(t*6|)*2t*5L", 22, 4) == [5, 6, 6, 5]
    assert parse_layout("E|t,t|tt|L", 4, 2) == [0, 2, 2, 0]


TINY = ["plan", "--model", "gpt-tiny", "--gpus", "8", "--cluster", "cpu-gloo"]


@pytest.mark.parametrize("flags, message", [
    ("--micro-batch-size 1 --foo 3", "unknown Megatron-LM flag --foo"),
    ("--tensor-model-parallel-size 3 --micro-batch-size 1", "--tensor-model-parallel-size 3 x"),
    ("--tensor-model-parallel-size 2", "--micro-batch-size is missing"),
    ("--micro-batch-size 1 --num-layers 12", "--num-layers 12 contradicts the model gpt-tiny"),
    ("--micro-batch-size 1 --swiglu", "--swiglu contradicts the model gpt-tiny"),
    ("--micro-batch-size 1 --recompute-granularity full", "needs --recompute-method"),
    ("--micro-batch-size 1 --recompute-activations --recompute-granularity full",
     "--recompute-activations (selective) contradicts --recompute-granularity full"),
    ("--micro-batch-size 1 --pipeline-model-parallel-size 2 "
     "--num-layers-per-virtual-pipeline-stage 2 --pipeline-model-parallel-layout 'Et*4|t*4L'",
     "are exclusive"),
    ("--micro-batch-size 1 --pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout 'Et*4|t*3L'", "places 7 transformer layers"),
    ("--micro-batch-size 1 --global-batch-size 17", "--global-batch-size 17 is not a multiple"),
    ("--micro-batch-size x", "--micro-batch-size: expected a positive integer"),
    ("--micro-batch-size 1 --micro-batch-size 2", "--micro-batch-size is given twice"),
    ("--micro-batch-size 1 --num-experts 8", "--num-experts"),
])
def test_megatron_errors_are_one_line_naming_the_flag(capsys, flags, message):
    assert main(TINY + ["--from-megatron", flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxpar: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("toml, message", [
    ("[parallelism]\ntensor_parallel_degre = 2\n", "[parallelism] tensor_parallel_degre"),
    ("[paralelism]\ntensor_parallel_degree = 2\n", "unknown torchtitan section [paralelism]"),
    ("[parallelism]\ntensor_parallel_degree = 3\n", "does not divide the 8 GPUs"),
    ("[parallelism]\ntensor_parallel_degree = \"2\"\n", "tensor_parallel_degree must be an int"),
    ("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "
     "\"ZBVZeroBubble\"\n", "'ZBVZeroBubble': fxpar has no such schedule"),
    ("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_split_points = "
     "[\"layers.5\", \"layers.3\"]\n", "split points must increase"),
    ("[parallelism]\ndata_parallel_shard_degree = 2\n", "replicate 1 x shard 2"),
    ("[training]\nseq_len = 64\n", None),
    ("not toml", "is not TOML"),
    ("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "
     "\"PipelineScheduleSingle\"\n", "needs pipeline_parallel_schedule_csv"),
])
def test_torchtitan_errors_are_one_line_naming_the_field(tmp_path, capsys, toml, message):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    code = main(TINY + ["--from-torchtitan", str(path)])
    captured = capsys.readouterr()
    if message is None:  # defaults filled in as torchtitan fills them, said in notes
        assert code == 0 and "torchtitan's default, mode = \"selective\"" in captured.out
        return
    err = captured.err.strip()
    assert code == 2 and err.startswith("fxpar: error:") and message in err and "\n" not in err


def test_contradictions_with_fxpar_flags(capsys, tmp_path):
    assert main(TINY + ["--seq", "16", "--from-megatron",
                        "--micro-batch-size 1 --seq-length 32"]) == 2
    assert "--seq-length 32 contradicts --seq 16" in capsys.readouterr().err
    assert main(TINY + ["--zero1", "--from-megatron", "--micro-batch-size 1"]) == 2
    assert "lack --use-distributed-optimizer" in capsys.readouterr().err
    assert main(TINY + ["--emit", "megatron", "--from-megatron", "--micro-batch-size 1"]) == 2
    assert "exclusive" in capsys.readouterr().err


def test_megatron_sizes_the_run_and_lists_what_it_ignores(capsys):
    assert main(TINY + ["--from-megatron", "pretrain_gpt.py --micro-batch-size 2 "
                        "--global-batch-size 32 --seq-length 16 --lr 3e-4 --data-path a b "
                        "--bf16"]) == 0
    out = capsys.readouterr().out
    assert "ignored (no effect on fxpar's price): --lr, --data-path" in out
    assert "micro-batch 2" in out.splitlines()[0]
    assert not math.isnan(float(re.search(r"Megatron-LM configuration: ([\d.e-]+) s", out)[1]))
