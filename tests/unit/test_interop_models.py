"""A model's definition in Megatron-LM flags, both ways, and the layouts a framework can state.

`--emit megatron` writes every property of the model Megatron-LM has a flag for (--kv-channels,
--qk-layernorm, the window, ...) and lists the rest as differences (never "expressed exactly");
`--from-megatron` refuses model flags that contradict the model, given or implied by absence;
`--emit` plans among the layouts the target states; `--from-torchtitan` says what it does with
compile, float8 and async tensor parallelism. The small configs below keep each family's
distinguishing fields (Mistral-NeMo's head width, Qwen3's q/k norms, Gemma-2's soft-capping and
windows, OLMo's norms and biases, GPT-2's positions and GELU) at sizes that plan in seconds."""
import re

import pytest

from planner.cli import main
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.interop.megatron_model import emitted_flags, padded_vocab, vocab_divisor
from planner.interop.model_facts import facts_of_config
from planner.models.presets import get_config
from tests.harness.hf_configs import config_file, hf_facts

pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
NEMO = {"model_type": "mistral", "hidden_size": 320, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256, "sliding_window": None,
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "rope_theta": 1e6,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
GEMMA2 = {"model_type": "gemma2", "hidden_size": 96, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "hidden_activation": "gelu_pytorch_tanh",
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "query_pre_attn_scalar": 64, "sliding_window": 16, "rms_norm_eps": 1e-6}
OLMO = {"model_type": "olmo", "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "attention_bias": True, "rope_theta": 5e5,
        "tie_word_embeddings": True}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024,
        "vocab_size": 256, "activation_function": "gelu_new"}
QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 128, "rope_theta": 1e6,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def _config(tmp_path, data: dict) -> str:
    return config_file(tmp_path, SMALL, data)


def _facts(tmp_path, data: dict, seq: int = 64):
    return hf_facts(tmp_path, SMALL, data, seq)


def _emit(capsys, tmp_path, data: dict, target: str = "megatron", gpus: int = 2) -> str:
    assert main(["plan", "--hf-config", _config(tmp_path, data), "--gpus", str(gpus),
                 "--cluster", "cpu-gloo", "--emit", target]) == 0
    return capsys.readouterr().out


def _refused(text: str, facts, gpus: int = 2) -> str:
    with pytest.raises(ValueError) as err:
        megatron_configuration(text, facts, gpus)
    return str(err.value)


# ---------------------------------------------------------------------------- 1. head width
def test_a_head_width_other_than_hidden_over_heads_is_kv_channels(tmp_path):
    facts = _facts(tmp_path, NEMO)
    flags, notes = emitted_flags(facts, 64)
    assert "--kv-channels 64" in flags and notes == []
    text = " ".join(flags) + " --micro-batch-size 1"
    assert megatron_configuration(text, facts, 2).config.dp == 2
    assert _refused(text.replace(" --kv-channels 64", ""), facts) == (
        "without --kv-channels 64 Megatron-LM's head width is 80 (its default), not the model "
        "MistralForCausalLM's 64: add --kv-channels 64")
    assert _refused(text.replace("--kv-channels 64", "--kv-channels 80"), facts) == (
        "--kv-channels 80 contradicts the model MistralForCausalLM, whose head width is 64, not "
        "80 (Megatron-LM states it with --kv-channels 64)")


def test_qwen3_exports_exactly_with_its_head_width_and_qk_norms(capsys, tmp_path):
    text = _emit(capsys, tmp_path, QWEN3)
    assert "--kv-channels 32 \\" in text and "--qk-layernorm \\" in text
    assert "expressed exactly: read back, it prices this very plan" in text
    assert "not expressible" not in text


# ---------------------------------------------------------------------------- 2. what else
def test_gemma2_lists_what_megatron_cannot_state(capsys, tmp_path):
    text = _emit(capsys, tmp_path, GEMMA2)
    head = [line for line in text.splitlines() if line.startswith("#")]
    for line in [
            "# not expressible: the MLP's activation gelu_pytorch_tanh, gated: Megatron-LM's "
            "gated MLPs are SiLU (--swiglu) and quick-GELU (--quick-geglu); nearest: "
            "--quick-geglu",
            "# not expressible: attention logits soft-capped at 50.0 (tanh): no Megatron-LM "
            "flag states it",
            "# not expressible: output logits soft-capped at 30.0 (tanh): no Megatron-LM flag "
            "states it",
            "# not expressible: token embeddings scaled by sqrt(hidden): no Megatron-LM flag "
            "states it",
            "# not expressible: 4 norms per layer (input_layernorm, post_attention_layernorm, "
            "pre_feedforward_layernorm, post_feedforward_layernorm): norms on the attention's "
            "and the MLP's outputs too: no Megatron-LM flag states it"]:
        assert line in head, text
    assert not any("expressed exactly" in line for line in head)
    assert "the same parallel plan (read back, it prices this very plan), for the nearest " \
           "model Megatron-LM can state: the differences above" in text
    # what it can state: head width, GeGLU's nearest, (1 + weight) norms, the alternating window
    for flag in ("--kv-channels 64", "--quick-geglu", "--normalization RMSNorm",
                 "--apply-layernorm-1p", "--window-size 15,0", "--window-attn-skip-freq 2"):
        assert f"{flag} \\" in text
    # query_pre_attn_scalar equal to the head width scales as Megatron-LM does; otherwise said
    assert not any("query_pre_attn_scalar" in line for line in head)
    facts = _facts(tmp_path, {**GEMMA2, "query_pre_attn_scalar": 32})
    assert ("attention scores scaled by query_pre_attn_scalar^-1/2 = 32^-1/2, not the head "
            "width's 64^-1/2: no Megatron-LM flag states it") in emitted_flags(facts, 64)[1]


def test_olmo_and_gpt2_definitions(tmp_path):
    flags, notes = emitted_flags(_facts(tmp_path, OLMO), 64)
    assert {"--swiglu", "--disable-bias-linear", "--add-qkv-bias"} <= set(flags)
    assert not any(f.startswith("--normalization") for f in flags)  # LayerNorm, not RMSNorm
    assert notes == [
        "LayerNorm without weight or bias: Megatron-LM's LayerNorm learns a weight and a bias; "
        "nearest: --normalization LayerNorm",
        "biases on the q/k/v projections and the attention's output projection but not the "
        "MLP: Megatron-LM has biases on every linear, on none (--disable-bias-linear) or on q/k/v "
        "only (--add-qkv-bias); nearest: --disable-bias-linear --add-qkv-bias"]
    # GPT-2 at --seq 512: its table of 1024 positions, and its tanh GELU
    flags, notes = emitted_flags(_facts(tmp_path, GPT2, seq=512), 512)
    assert "--max-position-embeddings 1024" in flags and "--seq-length 512" in flags
    assert "--openai-gelu" in flags and "--swiglu" not in flags and notes == []


# ---------------------------------------------------------------------------- 3. contradictions
@pytest.mark.parametrize("change, message", [
    (lambda t: t + " --untie-embeddings-and-output-weights",
     "--untie-embeddings-and-output-weights contradicts the model Qwen2ForCausalLM, whose output "
     "layer is tied to the embedding, not untied (Megatron-LM states it by leaving out "
     "--untie-embeddings-and-output-weights)"),
    (lambda t: t.replace("--rotary-base 1000000", "--rotary-base 10000"),
     "--rotary-base 10000 contradicts the model Qwen2ForCausalLM, whose rotary base is 1000000, "
     "not 10000 (Megatron-LM states it with --rotary-base 1000000)"),
    (lambda t: t.replace("--norm-epsilon 1e-06", "--norm-epsilon 1e-5"),
     "--norm-epsilon 1e-5 contradicts the model Qwen2ForCausalLM, whose norm epsilon is 1e-06, "
     "not 1e-05 (Megatron-LM states it with --norm-epsilon 1e-06)"),
    (lambda t: t.replace("--swiglu ", ""),
     "without --swiglu Megatron-LM's MLP is GELU (its default), not the model "
     "Qwen2ForCausalLM's SiLU-gated (SwiGLU): add --swiglu"),
    (lambda t: t.replace(" --add-qkv-bias", ""),
     "--disable-bias-linear contradicts the model Qwen2ForCausalLM, whose linear biases are on "
     "the q/k/v projections only, not on no linear (Megatron-LM states it with "
     "--disable-bias-linear --add-qkv-bias)"),
    (lambda t: t.replace("--normalization RMSNorm ", ""),
     "without --normalization RMSNorm Megatron-LM's normalization is LayerNorm (its default), "
     "not the model Qwen2ForCausalLM's RMSNorm: add --normalization RMSNorm"),
    (lambda t: t.replace("--normalization RMSNorm", "--normalization LayerNorm"),
     "--normalization LayerNorm contradicts the model Qwen2ForCausalLM, whose normalization is "
     "RMSNorm, not LayerNorm (Megatron-LM states it with --normalization RMSNorm)"),
    (lambda t: t.replace("--num-query-groups 2", "--num-query-groups 4"),
     "--group-query-attention --num-query-groups 4 contradicts the model Qwen2ForCausalLM, whose "
     "number of key/value heads is 2, not 4 (Megatron-LM states it with --group-query-attention "
     "--num-query-groups 2)"),
])
def test_megatron_model_flags_contradicting_the_model_are_errors(tmp_path, change, message):
    facts = _facts(tmp_path, QWEN2)
    text = " ".join(emitted_flags(facts, 64)[0]) + " --micro-batch-size 1 --global-batch-size 2"
    assert megatron_configuration(text, facts, 2).notes == []  # as emitted: the model
    assert _refused(change(text), facts) == message


def test_every_megatron_model_contradiction_is_named_at_once(tmp_path):
    """A user fixes them in one go, not one per run: each one's message, in one line."""
    facts = _facts(tmp_path, QWEN2)
    text = " ".join(emitted_flags(facts, 64)[0]) + " --micro-batch-size 1 --global-batch-size 2"
    both = text.replace("--swiglu ", "").replace("--rotary-base 1000000", "--rotary-base 10000")
    said = _refused(both, facts)
    assert said.startswith("--rotary-base 10000 contradicts") and "\n" not in said
    assert "; without --swiglu Megatron-LM's MLP is GELU (its default)" in said


def test_parallel_flags_alone_are_priced_as_the_model_and_say_so(tmp_path, capsys):
    facts = _facts(tmp_path, QWEN2)
    notes = megatron_configuration("--micro-batch-size 1 --global-batch-size 2", facts, 2).notes
    assert notes == ["the flags do not define the model (no --num-layers, --swiglu, ...): priced "
                     "as Qwen2ForCausalLM, as --model/--hf-config gives it"]
    # on the command line: one line, exit status 2
    assert main(["plan", "--hf-config", _config(tmp_path, QWEN2), "--gpus", "2", "--cluster",
                 "cpu-gloo", "--from-megatron", "--micro-batch-size 1 --rotary-base 10000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpar: error: --rotary-base 10000 contradicts the model") and \
        err.count("\n") == 1


# ---------------------------------------------------------------------------- 4. real flags
LLAMA = facts_of_config(get_config("llama-tiny", layers=4))


def _read(flags: str, gpus: int = 4):
    return megatron_configuration(flags, LLAMA, gpus)


def test_megatron_flags_of_other_names_and_numerics_are_read():
    pp = "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 "
    assert _read(pp + "--virtual-pipeline-model-parallel-size 2").config == \
        _read(pp + "--num-virtual-stages-per-pipeline-rank 2").config
    first = _read(pp + "--num-layers-in-first-pipeline-stage 1").config
    assert first == _read(pp + "--decoder-first-pipeline-num-layers 1").config
    assert [len(st) for st in first.stages] == [1, 3]
    assert [len(st) for st in _read(pp + "--num-layers-in-last-pipeline-stage 1").config
            .stages] == [3, 1]
    with pytest.raises(ValueError, match="--num-layers-in-first-pipeline-stage 1 and "
                                         "--decoder-first-pipeline-num-layers 2 name one setting"):
        _read(pp + "--num-layers-in-first-pipeline-stage 1 --decoder-first-pipeline-num-layers 2")
    model = " ".join(emitted_flags(LLAMA, LLAMA.seq)[0]) + " --micro-batch-size 1"
    assert _read(model + f" --kv-channels {LLAMA.kv_channels} --rotary-percent 1.0")
    notes = _read(model + " --apply-query-key-layer-scaling").notes
    assert notes[0].startswith("--apply-query-key-layer-scaling scales the attention scores")
    for flags, message in [
            (model + " --rotary-percent 0.5", "--rotary-percent 0.5 contradicts the model "
             "llama-tiny, whose share of each head the rotary turns is 1, not 0.5 (Megatron-LM "
             "states it by leaving out --rotary-percent)"),
            (model.replace("--swiglu", "--squared-relu"), "--squared-relu contradicts the model "
             "llama-tiny, whose MLP is SiLU-gated (SwiGLU), not squared ReLU (Megatron-LM states "
             "it with --swiglu)"),
            (model + " --qk-layernorm", "--qk-layernorm contradicts the model llama-tiny, whose "
             "q/k normalization is absent, not present (Megatron-LM states it by leaving out "
             "--qk-layernorm)")]:
        with pytest.raises(ValueError) as err:
            _read(flags)
        assert str(err.value) == message


def test_megatron_vocabulary_padding_is_pinned_on_emit_and_said_on_import():
    """Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x tp
    (128 x tp by default): emitted, the divisor keeps the model's rows; imported, padding is
    said with its size, from the brute-force padding."""
    for vocab in (32000, 50257, 151936, 128256, 1000):
        for tp in (1, 2, 4, 8):
            d = vocab_divisor(vocab, tp)
            padded = padded_vocab(vocab, d, tp)
            assert padded == next(n for n in range(vocab, vocab + d * tp)
                                  if n % (d * tp) == 0)
            assert (padded == vocab) == (vocab % tp == 0)
    model = " ".join(emitted_flags(LLAMA, LLAMA.seq)[0]) + " --micro-batch-size 1"
    tp4 = model + " --tensor-model-parallel-size 4"
    assert LLAMA.vocab % 512 and not any("pads" in n for n in
                                         _read(tp4 + " --make-vocab-size-divisible-by 1").notes)
    pad = padded_vocab(LLAMA.vocab, 128, 4)
    assert f"Megatron-LM pads the vocabulary from {LLAMA.vocab} to {pad} rows (a multiple of " \
           f"--make-vocab-size-divisible-by 128 x tp 4)" in " ".join(_read(tp4).notes)


def test_a_single_megatron_flag_says_to_attach_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "gpt-tiny", "--gpus", "8", "--cluster", "cpu-gloo",
              "--from-megatron", "--sequence-parallel"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "attach them, --from-megatron='--sequence-parallel ...'" in err and \
        err.count("\n") == 1


# ---------------------------------------------------------------------------- 5. layouts
NEAREST = re.compile(r"# fxpar plan: ([\d.]+) s/iteration; nearest (?:torchtitan|Megatron-LM) "
                     r"configuration: ([\d.]+) s/iteration")


def test_torchtitan_emit_plans_among_what_torchtitan_states(capsys, tmp_path):
    """llama2-70b on 64 H100s: fxpar's plan is ZeRO-1, which torchtitan cannot state; converted
    to FSDP on its mesh it is 29% slower, so the emit plans among zero 0 and 3 instead."""
    args = ["plan", "--model", "llama2-70b", "--gpus", "64", "--cluster", "h100-sxm-dgx"]
    assert main(args + ["--emit", "torchtitan"]) == 0
    text = capsys.readouterr().out
    assert "zero=1" in text.splitlines()[0]
    assert "# nearest: the fastest of the layouts torchtitan can state (zero 0 or 3: replicas or " \
           "FSDP), planned: " in text and "fxpar's plan converted prices at 75.51 s/iteration" \
           in text
    ours, theirs = map(float, NEAREST.search(text).groups())
    assert ours == pytest.approx(58.67, rel=1e-3) and theirs < 1.05 * ours
    assert "data_parallel_replicate_degree = 1" in text and "prices another plan" not in text
    (tmp_path / "job.toml").write_text(text)
    assert main(args + ["--from-torchtitan", str(tmp_path / "job.toml")]) == 0
    assert f"torchtitan configuration: {theirs:.4g} s/iteration" in capsys.readouterr().out


def test_megatron_emit_plans_among_its_schedules(capsys):
    args = ["plan", "--model", "llama-tiny", "--layers", "4", "--gpus", "4", "--cluster",
            "cpu-gloo", "--fix", "pp=2,schedule=zb-h1", "--emit", "megatron"]
    assert main(args) == 0
    text = capsys.readouterr().out
    # the conversion's nearest (1f1b) is not said beside the planned one: one nearest
    assert "# not expressible: Megatron-LM has no zb-h1 schedule\n" in text
    assert text.count("# nearest") == 1
    assert "# nearest: the fastest of the layouts Megatron-LM can state (schedules 1f1b and " \
           "interleaved-1f1b), planned: " in text
    assert "prices another plan" not in text
    back = main(args[:-2] + ["--from-megatron", text])
    assert back == 0 and f"configuration: {NEAREST.search(text).group(2)} s/iteration" in \
        capsys.readouterr().out


# ---------------------------------------------------------------------------- 6. torchtitan
def test_torchtitan_compile_float8_and_async_tp_are_said(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["float8"]\n'
                    '[compile]\nenable = true\ncomponents = ["model", "loss"]\n'
                    '[parallelism]\ntensor_parallel_degree = 2\n'
                    'enable_async_tensor_parallel = true\n[training]\nlocal_batch_size = 2\n'
                    'seq_len = 256\nsteps = 10\n[activation_checkpoint]\nmode = "none"\n')
    args = ["plan", "--model", "llama-tiny", "--layers", "4", "--gpus", "8", "--cluster",
            "h100-sxm-dgx", "--from-torchtitan", str(path)]
    assert main(args) == 0
    compiled = capsys.readouterr().out
    for line in [
            'note: [model] converters = ["float8"]: low-precision (float8/MX) matmuls are not '
            'priced: fxpar prices them in bf16',
            "note: enable_async_tensor_parallel = true (tensor-parallel collectives overlapped "
            "with their matmuls): not priced: fxpar's torchtitan profiles wait on each "
            "tensor-parallel collective",
            "note: torch.compile ([compile] enable = true): priced under the torchtitan-compile "
            "runtime profile (pointwise chains fused), fxpar's plan too",
            "ignored (no effect on fxpar's price): [model] name, flavor (the model comes from "
            "--model/--hf-config), [training] steps"]:
        assert line in compiled.splitlines(), compiled
    assert main(args + ["--runtime", "torchtitan"]) == 0
    eager = capsys.readouterr().out
    assert "priced under the torchtitan runtime profile (--runtime, or CPU ranks), not " \
           "torchtitan-compile" in eager
    price = re.compile(r"torchtitan configuration: ([\d.e-]+) s/iteration")
    assert price.search(compiled)[1] != price.search(eager)[1]
    imported = torchtitan_configuration(str(path), LLAMA, 8)
    assert imported.runtime == "torchtitan-compile"


# ---------------------------------------------------------------------------- 7. GPT-2's ends
def test_gpt2_ends_split_over_the_vocabulary_as_the_targets_split_them(capsys):
    """GPT-2 looks its tokens up through a view of input_ids, a re-shape the vocabulary-parallel
    rewrite follows (passes.rewrite.vocab_parallel): its ends split at tp=2 as Megatron-LM's and
    torchtitan's do, so the emit prices the target's split ends at fxpar's tp instead of planning
    around ends that cannot split; that fxpar keeps them whole at these sizes is its prices'
    choice, said as such."""
    base = ["plan", "--hf", "gpt2", "--gpus", "8", "--cluster", "h100-sxm-dgx"]
    for target, label in (("megatron", "Megatron-LM"), ("torchtitan", "torchtitan")):
        csv = ["--emit-csv", "/dev/null"] if target == "torchtitan" else []
        assert main(base + ["--emit", target] + csv) == 0
        text = capsys.readouterr().out
        assert "tp=2" in text.splitlines()[0]
        assert "cannot be split there" not in text and "not vocabulary-parallel" not in text
        assert f"fxpar keeps the embedding and head replicated at tp=2; {label} always splits " \
               f"them over the vocabulary" in text
        assert "prices another plan" not in text
    assert "tensor_parallel_degree = 2" in text  # torchtitan's: fxpar's tp, its ends split


@pytest.mark.parametrize("arch, flag", [("t5", ["--emit", "megatron"]),
                                        ("llava", ["--emit", "torchtitan"]),
                                        ("t5", ["--from-megatron", "--micro-batch-size 1"])])
def test_a_model_of_several_parts_is_not_written_as_a_decoder_only_one(arch, flag, capsys):
    """Megatron-LM's GPT flags and torchtitan's model code state one chain of decoder blocks: an
    encoder-decoder or a vision-language model is refused, its lists of blocks named."""
    assert main(["plan", "--hf", arch, "--gpus", "4", "--cluster", "h100-sxm-dgx", *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 2 lists of blocks (" in err and \
        "so neither states this model" in err, err
    assert err.startswith(f"fxpar: error: {flag[0]}{' megatron' if flag[1] == 'megatron' else ''}"
                          f"{' torchtitan' if flag[1] == 'torchtitan' else ''}:"), err


@pytest.mark.parametrize("flag", [["--emit", "megatron"], ["--from-megatron", "--num-layers 2"]])
def test_a_diffusion_transformer_is_not_written_as_a_language_model(flag, capsys):
    assert main(["plan", "--model", "dit-tiny", "--gpus", "4", "--cluster", "h100-sxm-dgx",
                 *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dit-tiny is a diffusion transformer" in err, err
