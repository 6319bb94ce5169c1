"""What fxpar tells before training is true: exports that are exact or say what differs (read
back with --from-*), imports priced as the framework runs them, sizes stated with where they
came from, refusals and numbers in clean words."""
import json

import pytest
import torch

from planner.api import plan
from planner.cli import main
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.interop.emit import facts_of_config, facts_of_hf
from planner.interop.round_trip import differences
from planner.models.presets import get_config
from planner.report.explain import binding_constraint, diff, next_best

transformers = pytest.importorskip("transformers")

ROUND_TRIP_EXACT = "expressed exactly: read back, it prices this very plan"
# One fixed plan per kind: replicas, each ZeRO level, hybrid sharding, tp, tp+sp, a pipeline,
# interleaving, context parallel, recomputation
PLAN_KINDS = {"dp": "dp=4,zero=0", "zero1": "dp=4,zero=1", "zero2": "dp=4,zero=2",
              "zero3": "dp=4,zero=3", "hsdp": "dp=4,zero=3,dp_shard=2",
              "tp": "tp=2,dp=2,strategy=tp", "tp+sp": "tp=2,dp=2,strategy=tp+sp",
              "pp": "pp=2,dp=2,schedule=1f1b", "interleaved": "pp=2,v=2,schedule=interleaved-1f1b",
              "cp": "cp=2,dp=2", "full": "dp=4,strategy=full"}
MODELS = {"preset": ["--model", "llama-tiny", "--layers", "4"],
          "qwen2": ["--hf", "qwen2", "--layers", "4"],
          "gpt2": ["--hf", "gpt2", "--layers", "4"]}


def _emit(capsys, model: list, fix: str, target: str, status: int = 0) -> str:
    assert main(["plan", *model, "--gpus", "4", "--cluster", "cpu-gloo", "--global-batch", "16",
                 "--fix", fix, "--emit", target]
                + ["--emit-csv", "/dev/null"] * (target == "torchtitan")) == status
    out = capsys.readouterr()
    return out.out if status == 0 else out.err


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
@pytest.mark.parametrize("kind", PLAN_KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_emit_is_exact_by_its_round_trip_or_says_what_differs(capsys, model, kind, target):
    """Every plan kind × model family × trainer: the header says "expressed exactly" only where
    the output read back prices the same plan (the emitter reads it back itself), and otherwise
    names what the target cannot express with the nearest configuration's price."""
    # (GPT-2's lookup reads a view of the ids: fxpar keeps its ends whole under tp, which
    # neither target states; the emit plans at a tp whose ends split and says why)
    text = _emit(capsys, MODELS[model], PLAN_KINDS[kind], target)
    head = [line for line in text.splitlines() if line.startswith("#")]
    exact = any(ROUND_TRIP_EXACT in line for line in head)
    explained = any("not expressible" in line for line in head) and any(
        "nearest" in line for line in head)
    assert exact or explained, text
    assert "prices another plan" not in text, text


def test_what_the_round_trip_compares():
    pricer_plan = plan(get_config("llama-tiny", layers=4), 4, cluster="cpu-gloo",
                       fix={"dp": 4, "zero": 3})[0]
    other = plan(get_config("llama-tiny", layers=4), 4, cluster="cpu-gloo",
                 fix={"dp": 4, "zero": 1})[0]
    assert differences(pricer_plan, pricer_plan) == ""
    assert "zero 3 -> 1" in differences(pricer_plan, other)


def test_emit_states_the_plan_fxpar_plan_prints(capsys):
    args = ["--hf", "qwen2", "--layers", "4", "--gpus", "8", "--cluster", "h100-sxm-dgx",
            "--seq", "4096", "--global-batch", "64"]
    # --emit megatron plans under Megatron-Core's runtime profile, as --runtime megatron does,
    # and says so; fxpar's own runtime may plan another layout, which its header names
    assert main(["plan", *args, "--runtime", "megatron", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["plan", *args, "--emit", "megatron"]) == 0
    emitted = capsys.readouterr().out
    mesh = planned["mesh"]
    head = emitted.splitlines()[0]
    assert "fxpar's plan under the megatron runtime (`fxpar plan --runtime megatron`)" in head
    assert (f"(h100-sxm-dgx), dp={mesh['dp']} tp={mesh['tp']} pp={mesh['pp']} "
            f"cp={mesh.get('cp', 1)}" in head)
    assert main(["plan", *args]) == 0
    assert "(h100-sxm-dgx, fxpar runtime)" in capsys.readouterr().out.splitlines()[0]


def test_zero3_exports_shard_and_imports_as_zero3(tmp_path, capsys):
    model = ["--model", "llama-tiny", "--layers", "4"]
    toml = _emit(capsys, model, "dp=4,zero=3,dp_shard=4", "torchtitan")
    assert "data_parallel_shard_degree = 4" in toml and "data_parallel_replicate_degree = 1" \
        in toml
    hybrid = _emit(capsys, model, "dp=4,zero=3,dp_shard=2", "torchtitan")
    assert "data_parallel_shard_degree = 2" in hybrid and "data_parallel_replicate_degree = 2" \
        in hybrid and ROUND_TRIP_EXACT in hybrid
    flags = _emit(capsys, model, "dp=4,zero=3,dp_shard=4", "megatron")
    assert "--use-megatron-fsdp" in flags and "optim_grads_params" in flags
    assert "--use-distributed-optimizer" in _emit(capsys, model, "dp=4,zero=1", "megatron")
    facts = facts_of_config(get_config("llama-tiny", layers=4))
    path = tmp_path / "fsdp.toml"
    path.write_text("[parallelism]\ndata_parallel_shard_degree = -1\n[training]\n"
                    "local_batch_size = 4\nglobal_batch_size = 16\n")
    imported = torchtitan_configuration(str(path), facts, 4)
    assert (imported.config.zero, imported.config.dp, imported.config.dp_shard) == (3, 4, None)
    path.write_text("[parallelism]\ndata_parallel_shard_degree = 2\n"
                    "data_parallel_replicate_degree = 2\n[training]\nlocal_batch_size = 4\n")
    hsdp = torchtitan_configuration(str(path), facts, 4).config
    assert (hsdp.zero, hsdp.dp, hsdp.dp_shard) == (3, 4, 2)


def test_torchtitan_local_batch_is_one_forward():
    """Without a pipeline torchtitan runs local_batch_size in one forward and accumulates
    gradients over global // (local x dp): a plan of m micro-batches of b states local = b."""
    chosen = plan(get_config("llama-tiny", layers=4), 4, cluster="cpu-gloo",
                  fix={"dp": 4, "mb": 1})[0]
    from planner.interop.configuration import Pricer
    from planner.interop.emit import emit
    pricer = Pricer(get_config("llama-tiny", layers=4), 4, cluster="cpu-gloo")
    text, _ = emit("torchtitan", chosen, lambda: pricer)
    assert chosen.num_microbatches > 1 and "local_batch_size = 1" in text


def _qwen2_facts():
    from planner.models.hf import build_hf_from_file
    import tempfile
    data = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 8,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 256, "max_position_embeddings": 64, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    with torch.device("meta"):
        model = build_hf_from_file(f.name)
    return facts_of_hf(model, 64), f.name


def test_megatron_states_and_reads_the_model_definition(capsys):
    facts, path = _qwen2_facts()
    assert (facts.qkv_bias, facts.linear_bias, facts.rope_theta, facts.norm_eps) == (
        True, False, 1e6, 1e-6)
    assert main(["plan", "--hf-config", path, "--gpus", "2", "--cluster", "cpu-gloo",
                 "--emit", "megatron"]) == 0
    text = capsys.readouterr().out
    for flag in ("--add-qkv-bias", "--disable-bias-linear", "--rotary-base 1000000",
                 "--norm-epsilon 1e-06", "--untie-embeddings-and-output-weights"):
        assert flag in text
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --micro-batch-size 1 "
            "--disable-bias-linear --add-qkv-bias --rotary-base 1000000 --swiglu --normalization "
            "RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --group-query-attention "
            "--num-query-groups 2 --untie-embeddings-and-output-weights")
    assert megatron_configuration(base, facts, 2).config.dp == 2
    with pytest.raises(ValueError, match="--rotary-base 10000 contradicts"):
        megatron_configuration(base.replace("1000000", "10000"), facts, 2)
    with pytest.raises(ValueError, match="--disable-bias-linear contradicts the model"):
        megatron_configuration(base.replace(" --add-qkv-bias", ""), facts, 2)


def test_config_keys_the_config_class_does_not_know_are_an_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layer": 4}))
    assert main(["plan", "--hf-config", str(path), "--gpus", "2", "--cluster", "cpu-gloo"]) == 2
    err = capsys.readouterr().err
    assert "'num_hidden_layer' is not a field" in err and "'num_hidden_layers'" in err


def test_size_flags_apply_to_hf_and_are_refused_with_hf_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama"}))
    assert main(["plan", "--hf-config", str(path), "--gpus", "2", "--layers", "4"]) == 2
    assert "--layers does not apply to --hf-config" in capsys.readouterr().err
    counts = []
    for layers in ("2", "4"):
        assert main(["plan", "--hf", "llama", "--layers", layers, "--gpus", "2", "--cluster",
                     "cpu-gloo", "--json"]) == 0
        counts.append(json.loads(capsys.readouterr().out)["params"])
    assert counts[1] > counts[0]


def test_the_plan_states_its_sizes_and_their_sources(capsys):
    assert main(["plan", "--hf", "llama", "--gpus", "2", "--cluster", "cpu-gloo"]) == 0
    out = capsys.readouterr().out
    assert "seq 32: the config's maximum positions (--seq to plan another)" in out
    assert "global batch: default (--global-batch to change)" in out
    model = transformers.AutoModelForCausalLM.from_config(
        __import__("planner.models.hf", fromlist=["small_config"]).small_config("llama"))
    assert f"model {sum(p.numel() for p in model.parameters()) / 1e3:.3g}K parameters" in out


def test_a_presets_sizes_say_whether_a_flag_changed_them(capsys):
    said = {}
    for flags in ([], ["--seq", "64"], ["--global-batch", "32"]):
        assert main(["plan", "--model", "gpt-tiny", "--gpus", "2", *flags]) == 0
        said[tuple(flags)] = capsys.readouterr().out
    assert "seq 32: preset   global batch: preset" in said[()]
    assert "seq 64: given   global batch: preset" in said[("--seq", "64")]
    assert "seq 32: preset   global batch: given" in said[("--global-batch", "32")]


class _Images(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(2))

    def forward(self, x, y):
        h = x.flatten(1)
        for block in self.blocks:
            h = torch.relu(block(h))
        return torch.nn.functional.mse_loss(h, y.flatten(1))


def test_inputs_that_are_not_sequences_are_counted_in_samples():
    images = torch.randn(8, 3, 4, 4)
    chosen = plan(_Images(), 2, (images, images), cluster="cpu-gloo", sequence_dim=None)[0]
    text = str(chosen)
    assert "samples/s" in text and "tokens/s" not in text and " seq " not in text
    assert chosen.seq == 1
    told = str(plan(_Images(), 2, (images, images), cluster="cpu-gloo")[0])
    assert "seq 3: dim 1 of the first example input [8, 3, 4, 4]" in told
    with pytest.raises(ValueError, match="sequence_dim=2"):
        plan(_Images(), 2, (images, images), cluster="cpu-gloo", sequence_dim=2)


def test_zero_ties_and_misfits_in_clean_words():
    chosen = plan(get_config("gpt-tiny"), 8, cluster="cpu-gloo", fix={"pp": 1})[0]
    assert "bubble 0 " in str(chosen) and "e-1" not in str(chosen).split("bubble")[1][:12]
    piped = plan(get_config("gpt-tiny"), 8, cluster="cpu-gloo", fix={"pp": 2})[0]
    assert "+8" not in diff(chosen, piped) and "from 0" in diff(chosen, piped)
    assert "ties with the winner" in next_best([chosen, chosen])
    from dataclasses import replace
    squeezed = replace(chosen, memory_limit_bytes=chosen.predicted.peak_memory_bytes / 2)
    assert binding_constraint(squeezed).startswith("memory: it does not fit")
    # a compute-bound plan within 5% of the limit is held by memory, not "neither memory ..."
    full = replace(chosen, memory_limit_bytes=chosen.predicted.peak_memory_bytes * 1.02,
                   predicted=replace(chosen.predicted, comm_s=0.0, bubble_s=0.0))
    assert binding_constraint(full).startswith("memory: the fullest device"), \
        binding_constraint(full)
    assert "1 layer:" in diff(chosen, replace(chosen, stages=chosen.stages[:1] + (replace(
        chosen.stages[0], layers=("head",), strategies=("none",)),)))


def test_a_bubble_fraction_over_one_says_what_it_is_a_fraction_of():
    """Idle over compute time, (p - 1)/m under 1F1B: 7 at 8 stages and one micro-batch, which
    is no share of the iteration - the plan says so."""
    few = plan(get_config("gpt-tiny"), 8, cluster="cpu-gloo", global_batch=1,
               fix={"pp": 8, "schedule": "1f1b"})[0]
    assert few.predicted.bubble_fraction >= 1
    assert "(idle over compute time" in str(few)
    assert "idle over compute" not in str(plan(get_config("gpt-tiny"), 1, cluster="cpu-gloo")[0])


class _EncoderDecoder(torch.nn.Module):
    """nn.TransformerEncoderLayer / DecoderLayer: torch's fused modules, two lists of layers."""

    def __init__(self, vocab=64, hidden=32, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.enc = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            hidden, 4, 64, dropout=0.0, batch_first=True) for _ in range(layers))
        self.dec = torch.nn.ModuleList(torch.nn.TransformerDecoderLayer(
            hidden, 4, 64, dropout=0.0, batch_first=True) for _ in range(layers))
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, src, tgt):
        memory = self.embed(src)
        for layer in self.enc:
            memory = layer(memory)
        x = self.embed(tgt)
        for layer in self.dec:
            x = layer(x, memory)
        return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), tgt.flatten())


def test_what_the_plan_cannot_see_it_says():
    import warnings
    from cost_model.ops.fallback import UnpricedOpWarning
    batch = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnpricedOpWarning)  # fused modules priced by their ops
        chosen = plan(_EncoderDecoder(), 4, batch, cluster="cpu-gloo")[0]
    # the encoder's and the decoder's layers are two parts of one chain, both split into blocks
    layers = [l for st in chosen.stages for l in st.layers]
    assert [l for l in layers if l not in ("embed", "head")] == \
        ["enc.0", "enc.1", "dec.0", "dec.1"]
    assert not any(n.startswith("only ") for n in chosen.notes)
    assert "part" in str(chosen) and "dec " in str(chosen)
    assert all(st.time_s > 0 for st in chosen.stages)


class _Unpriced(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = torch.special.erfcx(block(h))  # no cost rule
        return torch.nn.functional.cross_entropy(h.flatten(0, 1), y.flatten() % 8)


def test_ops_priced_without_a_rule_are_named_in_the_plan():
    batch = (torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8)))
    chosen = plan(_Unpriced(), 2, batch, cluster="cpu-gloo")[0]
    assert any("without a cost rule" in n and "erfcx" in n for n in chosen.notes), chosen.notes


@pytest.mark.parametrize("name,tie", [("gpt-tiny", False), ("gpt-tiny", True),
                                      ("llama-tiny", False), ("llama-tiny", True)])
def test_a_preset_exports_a_config_json_that_builds_the_same_model(name, tie):
    """The config.json an export writes beside a preset's weights: transformers builds from it
    the model that, given those weights under Hugging Face names, computes the same loss."""
    from planner.models.presets import build_model, example_batch
    from planner.weights.export import CONFIG, model_files
    from planner.weights.hf_weights import name_map
    config = get_config(name, layers=2, tie=tie)
    torch.manual_seed(0)
    model = build_model(config)
    files = model_files(model)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**json.loads(files[CONFIG])))
    params = dict(model.named_parameters())
    state = {ref.name: (params[n].t() if ref.transpose else params[n]).detach()
             for n, ref in name_map(model).entries}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "masked_bias")) or
                                  (tie and "lm_head" in k) for k in missing), missing
    tokens, targets = example_batch(config, 4)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(theirs.flatten(0, 1), targets.flatten())
        torch.testing.assert_close(loss, model(tokens, targets))


def test_a_run_extended_past_its_schedule_says_what_its_lr_does():
    import dataclasses
    from planner.training.schedule import LRSchedule
    from planner.training.train import schedule_change
    old, new = LRSchedule(1e-3, 0, "cosine", 40), LRSchedule(1e-3, 0, "cosine", 80)
    text = schedule_change({"extra": {"lr_schedule": dataclasses.asdict(old)}}, new, 40)
    assert "step 41 now trains at 0.00048" in text and "decay_steps = 40" in text
    assert schedule_change({"extra": {"lr_schedule": dataclasses.asdict(old)}}, old, 40) is None
    assert schedule_change({"extra": {}}, new, 40) is None  # saved before schedules were kept


def test_megatron_tensor_and_sequence_parallel_of_a_hf_model_is_priced(capsys):
    """The configurations refused before: tp=2 of a Hugging Face model (its vocabulary-parallel
    loss reads the logits through a float upcast) and tp=2 with --sequence-parallel."""
    _, path = _qwen2_facts()
    flags = ("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
             "--global-batch-size 8 --seq-length 32")
    assert main(["plan", "--hf-config", path, "--gpus", "4", "--cluster", "cpu-gloo",
                 "--from-megatron", flags]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM configuration: dp=2 tp=2" in out and "layers tp+sp" in out


def test_the_sequence_comes_from_the_config_positions_or_is_asked_for():
    from types import SimpleNamespace as NS

    from planner.models.hf import sequence_length

    def model(**config):
        return NS(model=NS(config=NS(**config)))
    assert sequence_length(model(n_positions=1024, max_position_embeddings=2048)) == 1024
    assert sequence_length(model(max_position_embeddings=2048)) == 2048
    # LED's two tables: the encoder's positions
    assert sequence_length(model(max_encoder_position_embeddings=16384,
                                 max_decoder_position_embeddings=1024)) == 16384
    with pytest.raises(ValueError, match=r"give the sequence length \(--seq\)"):
        sequence_length(model(vocab_size=8))
