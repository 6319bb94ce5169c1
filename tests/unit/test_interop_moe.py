"""Mixtures of experts, latent attention and the numbers of a model's definition, both ways
through Megatron-LM's flags; torchtitan's context-parallel sharding said alike by the export
and the import; what the importers name and ignore; percentages on one baseline.

The configs keep each family's distinguishing fields (Mixtral's fused SwiGLU experts, DeepSeek-V2's
latent attention, shared experts and dense first layer) at sizes that plan in seconds."""
from dataclasses import replace

import pytest

from planner.cli import main
from planner.interop.configuration import Pricer
from planner.interop.emit import facts_of_config, nearest
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.interop.megatron_model import check, emitted_flags
from planner.interop.model_facts import ModelFacts
from planner.interop.round_trip import emit_checked
from planner.models.presets import get_config
from planner.report.explain import diff
from tests.harness.hf_configs import config_file, hf_facts

pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 4,
           "num_experts_per_tok": 2, "rope_theta": 1e6, "tie_word_embeddings": False}
DSV2 = {"model_type": "deepseek_v2", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 160, "moe_intermediate_size": 32,
        "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "num_hidden_layers": 3, "kv_lora_rank": 16,
        "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "norm_topk_prob": False, "tie_word_embeddings": False}


def _config(tmp_path, data: dict) -> str:
    return config_file(tmp_path, SMALL, data)


def _facts(tmp_path, data: dict, seq: int = 64):
    return hf_facts(tmp_path, SMALL, data, seq)


def _text(facts, extra: str = "") -> str:
    return " ".join(emitted_flags(facts, 64)[0]) + " --micro-batch-size 1 " + extra


def _refused(text: str, facts, gpus: int = 2) -> str:
    with pytest.raises(ValueError) as err:
        megatron_configuration(text, facts, gpus)
    return str(err.value)


# ------------------------------------------------------------------------ 1. experts
def test_mixtral_exports_its_experts_and_swiglu_and_reads_them_back(tmp_path, capsys):
    facts = _facts(tmp_path, MIXTRAL)
    assert facts.gated  # transformers 5's fused gate_up_proj, no nn.Linear
    assert (facts.experts.count, facts.experts.top_k, facts.experts.ffn) == (4, 2, 128)
    args = ["plan", "--hf-config", _config(tmp_path, MIXTRAL), "--gpus", "2", "--cluster",
            "cpu-gloo", "--fix", "ep=1", "--emit", "megatron"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for flag in ("--swiglu", "--num-experts 4", "--moe-router-topk 2",
                 "--moe-ffn-hidden-size 128"):
        assert f"\n{flag} \\" in out, flag
    assert "expressed exactly: read back, it prices this very plan" in out
    text = _text(facts, "--expert-model-parallel-size 1")
    assert megatron_configuration(text, facts, 2).notes[:1] == [
        "no --global-batch-size: Megatron-LM's default, --micro-batch-size x data parallel = 2"]


def test_expert_flags_must_be_the_model(tmp_path):
    facts = _facts(tmp_path, MIXTRAL)
    text = _text(facts)
    assert _refused(text.replace("--num-experts 4 ", ""), facts) == (
        "without --num-experts 4 Megatron-LM's number of experts is none (a dense MLP) (its "
        "default), not the model MixtralForCausalLM's 4: add --num-experts 4")
    assert _refused(text.replace("--moe-router-topk 2", "--moe-router-topk 1"), facts) == (
        "--moe-router-topk 1 contradicts the model MixtralForCausalLM, whose number of experts "
        "per token (top-k) is 2, not 1 (Megatron-LM states it with --moe-router-topk 2)")
    assert megatron_configuration(text + " --expert-model-parallel-size 2", facts,
                                  2).config.ep == 2  # (tests/unit/test_interop_ep.py: the rest)
    dense = facts_of_config(get_config("llama-tiny"))
    assert _refused(_text(dense, "--num-experts 8"), dense).startswith(
        "--num-experts 8 contradicts the model")


def test_presets_state_their_experts():
    flags = " ".join(emitted_flags(facts_of_config(get_config("deepseek-v3")), 4096)[0])
    for flag in ("--num-experts 256", "--moe-router-topk 8", "--moe-ffn-hidden-size 2048",
                 "--moe-shared-expert-intermediate-size 2048",
                 "--moe-layer-freq '([0]*3+[1]*58)'", "--moe-router-score-function sigmoid",
                 "--moe-router-topk-scaling-factor 2.5", "--moe-router-num-groups 8",
                 "--moe-router-group-topk 4"):
        assert flag in flags, flag


# ------------------------------------------------------------------------ 2. latent attention
def test_deepseek_v2_states_latent_attention_not_a_head_width(tmp_path):
    facts = _facts(tmp_path, DSV2)
    flags, notes = emitted_flags(facts, 64)
    text = " ".join(flags)
    assert "--kv-channels" not in text
    for flag in ("--multi-latent-attention", "--kv-lora-rank 16", "--qk-head-dim 16",
                 "--qk-pos-emb-head-dim 8", "--v-head-dim 16", "--num-experts 8",
                 "--moe-ffn-hidden-size 32", "--moe-shared-expert-intermediate-size 64",
                 "--moe-layer-freq '([0]*1+[1]*2)'", "--moe-router-pre-softmax"):
        assert flag in text, flag
    assert "--q-lora-rank" not in text
    assert megatron_configuration(text + " --micro-batch-size 1", facts, 2)
    assert _refused(text.replace("--kv-lora-rank 16", "--kv-lora-rank 32") +
                    " --micro-batch-size 1", facts).startswith("--kv-lora-rank 32 contradicts")


# ------------------------------------------------------------------------ 4. numbers
@pytest.mark.parametrize("change", [
    {"rotary_fraction": 2 / 3}, {"norm_eps": 1.1920929e-07},
    {"rope_scaling": "llama3", "rope_params": (
        ("factor", 8.123456789), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 8192))},
    {"rope_theta": 1234567.8}])
def test_numbers_read_back_as_written(change):
    facts = ModelFacts("M", "llama", 2, 64, 4, 4, 128, 256, 64, False, position="rope",
                       rope_theta=10000.0, norm="RMSNorm", gated=True, activation="silu",
                       qkv_bias=False, out_bias=False, mlp_bias=False, norm_eps=1e-5)
    facts = replace(facts, **change)
    megatron_configuration(_text(facts), facts, 2)  # no contradiction with its own output
    flags = _text(facts)
    assert "0.666667 " not in flags and "8.12346" not in flags
    assert "--norm-epsilon 1e-05" not in flags
    if "rope_theta" in change:  # an int flag: said, and the nearest written
        assert "--rotary-base 1234568" in flags
        assert emitted_flags(facts, 64)[1][0].startswith("the rotary base 1234567.8")


# ------------------------------------------------------------------------ 3. torchtitan cp
def test_torchtitan_fsdp_over_cp_is_zero3_over_dp_shard_times_cp(tmp_path):
    """torchtitan's FSDP mesh is dp_shard x cp, as fxpar's ZeRO-3 shards: with FSDP it is
    exact; replicas (zero=0) at cp > 1 become FSDP over the cp ranks alone (shard degree 1,
    replicated over dp), and read back as that very configuration."""
    pricer = Pricer(get_config("llama-tiny", layers=4), 8, cluster="h100-sxm-dgx",
                    global_batch=16, seq=256)
    facts = facts_of_config(get_config("llama-tiny", layers=4))
    fsdp = pricer.best(fix={"cp": 2, "zero": 3, "dp": 4, "tp": 1, "pp": 1})[0]
    text, _ = emit_checked("torchtitan", fsdp, pricer, facts)
    assert "expressed exactly: read back, it prices this very plan" in text
    replicas = pricer.best(fix={"cp": 2, "zero": 0, "dp": 4, "tp": 1, "pp": 1})[0]
    expressed = nearest("torchtitan", replicas, lambda: pricer)
    assert not expressed.exact and (expressed.config.zero, expressed.config.dp_shard) == (3, 1)
    assert expressed.notes[0].startswith("torchtitan shards the weights (FSDP) over the 2 "
                                         "context-parallel ranks whatever")
    text, _ = emit_checked("torchtitan", replicas, pricer, facts)
    assert "data_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1" in text
    (tmp_path / "job.toml").write_text(text)
    back = torchtitan_configuration(str(tmp_path / "job.toml"), facts, 8)
    assert back.config == expressed.config
    assert pricer.price(back.config).plan.predicted.peak_memory_bytes < \
        replicas.predicted.peak_memory_bytes  # the weights sharded over cp: less held


# ------------------------------------------------------------------------ 5, 6. importers
def test_every_unknown_megatron_flag_is_named_and_logging_is_ignored():
    facts = facts_of_config(get_config("llama-tiny"))
    text = ("--micro-batch-size 1 --foo 3 --exit-duration-in-mins 230 --eod-mask-loss --bar "
            "--tensorboard-dir /tb --wandb-project p --log-interval 10 --eval-iters 2")
    assert _refused(text, facts) == (
        "unknown Megatron-LM flags --foo, --bar (fxpar reads the parallel, batch, recompute and "
        "model flags and ignores optimizer, data and logging ones): remove them")
    ignored = megatron_configuration(text.replace("--foo 3 ", "").replace("--bar ", ""), facts,
                                     2).ignored
    assert ignored == ["--exit-duration-in-mins", "--eod-mask-loss", "--tensorboard-dir",
                       "--wandb-project", "--log-interval", "--eval-iters"]
    data = ("--micro-batch-size 1 --dataloader-type cyclic --no-create-attention-mask-in-dataloader "
            "--num-dataset-builder-threads 4 --calculate-per-token-loss")
    assert megatron_configuration(data, facts, 2).ignored == [
        "--dataloader-type", "--no-create-attention-mask-in-dataloader",
        "--num-dataset-builder-threads", "--calculate-per-token-loss"]


def test_megatron_flags_read_from_a_file_as_emit_writes_them(tmp_path):
    facts = facts_of_config(get_config("llama-tiny"))
    path = tmp_path / "job.flags"
    path.write_text("# a comment\n--micro-batch-size 2 \\\n  --log-interval 10\n")
    read = megatron_configuration(str(path), facts, 2)
    assert read.config.micro_batch == 2 and read.ignored == ["--log-interval"]
    with pytest.raises(ValueError, match="or a file of them, got 'nofile.flags', which is "
                                         "neither"):
        megatron_configuration("nofile.flags", facts, 2)


def test_torchtitan_unknown_fields_together_and_float8_without_converters(tmp_path):
    facts = facts_of_config(get_config("llama-tiny"))
    path = tmp_path / "job.toml"
    path.write_text("[training]\nlocal_batch_size = 1\ngradient_accumulation_steps = 2\n"
                    "[parallelism]\ntensor_paralel_degree = 1\n[float8]\nfilter_fqns = []\n")
    with pytest.raises(ValueError) as err:
        torchtitan_configuration(str(path), facts, 2)
    assert str(err.value) == (
        f"unknown torchtitan field [training] gradient_accumulation_steps, field [parallelism] "
        f"tensor_paralel_degree in {path}: remove or correct them")
    path.write_text('[model]\nname = "llama3"\n[training]\nlocal_batch_size = 1\n'
                    '[float8]\nfilter_fqns = ["output"]\n')
    imp = torchtitan_configuration(str(path), facts, 2)
    assert not any("float8" in n for n in imp.notes)
    assert "[float8] (no [model] converters enable it)" in imp.ignored


# ------------------------------------------------------------------------ 7. percentages
def test_percentages_round_first_and_share_one_baseline():
    from planner.report.explain import percent
    assert percent(1.0, 0.99996) == "0.0%" and percent(1.0, 1.00004) == "0.0%"
    assert percent(1.0, 1.039) == "+3.9%"
    pricer = Pricer(get_config("llama-tiny", layers=4), 8, cluster="h100-sxm-dgx",
                    global_batch=16, seq=256)
    a, b = pricer.best(top_k=2)[:2]
    row = next(line for line in diff(a, b).splitlines() if line.startswith("iteration_s"))
    assert row.split()[-1] == percent(a.predicted.iteration_s, b.predicted.iteration_s)


# ------------------------------------------------------------------------ 8. minor
def test_yarn_positions_read_where_the_model_is_yarn_scaled(tmp_path):
    facts = _facts(tmp_path, {**DSV2, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}})
    text = _text(facts).replace("--position-embedding-type rope", "--position-embedding-type yarn")
    notes = megatron_configuration(text, facts, 2).notes
    assert not any("(yarn)" in n for n in notes) and any(n.startswith(
        "--position-embedding-type yarn: the model's yarn-scaled") for n in notes)
    plain = _facts(tmp_path, DSV2)
    assert _refused(_text(plain).replace("--position-embedding-type rope",
                                         "--position-embedding-type yarn"), plain) == (
        "--position-embedding-type yarn contradicts the model DeepseekV2ForCausalLM, whose rotary "
        "embedding is not scaled, not yarn's: give --position-embedding-type rope")


def test_layers_per_stage_that_miss_the_pipeline_degree_say_the_count(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\npipeline_parallel_degree = 2\n"
                    'pipeline_parallel_schedule = "Interleaved1F1B"\n'
                    "pipeline_parallel_layers_per_stage = 4\n[training]\nlocal_batch_size = 4\n")
    with pytest.raises(ValueError) as err:
        torchtitan_configuration(str(path), facts_of_config(get_config("llama-tiny")), 2)
    assert str(err.value) == (
        "[parallelism] pipeline_parallel_layers_per_stage 4 makes ceil((8 layers + 2) / 4) = 3 "
        "stages, not a multiple of the pipeline_parallel_degree 2; try 1 or 3")
