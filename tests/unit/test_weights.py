"""Per-shard reads of safetensors checkpoints, the name map, and per-shard materialisation of a
meta model, in one process (the multi-rank runs are in tests/dist/test_real_weights.py)."""
import itertools
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from passes.capture.trace import capture
from passes.stages.program import Layout, rank_programs
from planner.weights.materialize import (MaterializeError, init_value, materialize_full,
                                 materialize_programs, init_source)
from planner.models.presets import build_model, example_batch, get_config
from planner.weights.hf_weights import (HFTensor, ShardReader, WeightsError, hf_model, name_map,
                             open_checkpoint, read_shard)
from runtime.programs.shards import ShardSpec, shard_specs
from runtime.training.tied import canonical_names

SPECS = [ShardSpec(d, p, i, c, pad) for d, p, c, pad in
         [(0, 2, 1, 0), (1, 2, 1, 0), (0, 4, 1, 0), (0, 2, 3, 0), (1, 2, 3, 0), (0, 4, 1, 2),
          (0, 2, 1, 2)] for i in range(p)] + [ShardSpec(d, 2, i, sizes=(6, 2, 4))
                                              for d in (0, 1) for i in range(2)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("transpose", [False, True])
def test_read_shard_equals_cutting_the_whole_tensor(tmp_path, spec, transpose):
    shape = [12 - spec.pad if spec.dim == 0 else 6, 12 - spec.pad if spec.dim == 1 else 6]
    full = torch.randn(shape)
    ref = HFTensor("w", transpose)
    save_file({"w": ref.to_hf(full)}, tmp_path / "model.safetensors")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        got = read_shard(f, ref, spec, tuple(shape), torch.float32)
    torch.testing.assert_close(got, spec.take(full), rtol=0, atol=0)


def _llama():
    return get_config("llama-tiny").with_(layers=2, heads=4, kv_heads=2, hidden=32, ffn=64,
                                          vocab=97, seq=8)


def test_shards_of_a_meta_model_are_slices_of_the_full_model_under_every_plan():
    """The init rule gives every tp rank the slice of the model materialize_full builds."""
    cfg = _llama().with_(tie=True)
    full = dict(materialize_full(build_model(cfg, device="meta"), seed=3).named_parameters())
    tokens = example_batch(cfg, 1)
    for tp, rank, vocab_tp in itertools.product((2, 4), range(2), (False, True)):
        model = build_model(cfg, device="meta")
        captured = capture(model, tuple(t.to("meta") for t in tokens))
        strategies = tuple((b.name, "tp") for b in captured.blocks)
        strategies += (("embed", "tp"), ("head", "tp")) if vocab_tp else ()
        layout = Layout(tp, strategies, (2, 2), pad_vocab=True)
        programs = rank_programs(captured, layout, rank, (0, 1))
        materialize_programs(programs.values(), model, canonical_names(captured.tied),
                             init_source(model, seed=3))
        for program in programs.values():
            specs = shard_specs(program.gm)
            for name, p in program.gm.named_parameters():
                want = full[canonical_names(captured.tied).get(name, name)].detach()
                want = specs[name].take(want) if name in specs else want
                torch.testing.assert_close(p.detach(), want, rtol=0, atol=0,
                                           msg=lambda m, n=name: f"tp={tp} rank {rank} {n}: {m}")
        assert all(p.is_meta for p in model.parameters()), "the user's meta model was changed"


def test_init_rule_depends_on_name_and_seed_only():
    cfg = _llama()
    a = init_value(build_model(cfg, device="meta"), "blocks.1.attn.k_proj.weight", seed=5)
    b = init_value(build_model(cfg.with_(layers=4), device="meta"),
                   "blocks.1.attn.k_proj.weight", seed=5)
    c = init_value(build_model(cfg, device="meta"), "blocks.1.attn.k_proj.weight", seed=6)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    bound = 1 / cfg.hidden ** 0.5   # nn.Linear's own init: kaiming uniform, a=sqrt(5)
    assert float(a.abs().max()) <= bound and float(a.abs().max()) > 0.9 * bound


def test_a_meta_buffer_without_config_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.register_buffer("table", torch.ones(3, device="meta"))
    from planner.weights.materialize import buffer_value
    with pytest.raises(MaterializeError, match="buffer table .*no cfg or config"):
        buffer_value(model, "table")


def test_a_meta_buffer_of_a_hugging_face_module_takes_transformers_init():
    """Gemma 2's scaled embedding keeps its scale, sqrt(hidden), as a non-persistent buffer and
    has no config of its own; transformers' _init_weights sets it, as it sets rotary tables."""
    transformers = pytest.importorskip("transformers")
    from planner.weights.materialize import buffer_value
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        model = transformers.Gemma2ForCausalLM(cfg)
    assert buffer_value(model, "model.embed_tokens.embed_scale").item() == \
        pytest.approx(32 ** 0.5)


def _hf_loss(hf, tokens, targets):
    """The loss of the transformers model's own logits, targets as given (as fxpar's take them)."""
    logits = hf.model(input_ids=tokens, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _hf_dir(tmp_path, arch, **overrides):
    pytest.importorskip("transformers")
    from planner.models.hf import build_hf
    torch.manual_seed(0)
    model = build_hf(arch, **overrides)
    model.model.save_pretrained(tmp_path)
    return model


def _loads_with_the_same_loss(folder, cfg, hf):
    """fxpar's model of `cfg` given the weights `hf` saved in `folder` (read through
    ShardReader), after checking that its loss equals the transformers model's."""
    model = build_model(cfg, device="meta")
    with ShardReader(str(folder), model) as reader:
        model = materialize_full(model, source=reader)
    tokens, targets = example_batch(cfg, 2)
    torch.testing.assert_close(model(tokens, targets), _hf_loss(hf, tokens, targets), rtol=1e-5,
                               atol=0)
    return model


def test_fxpar_llama_loads_a_hugging_face_llama(tmp_path):
    hf = _hf_dir(tmp_path, "llama", rms_norm_eps=1e-5)
    c = hf.model.config
    cfg = get_config("llama-tiny").with_(layers=c.num_hidden_layers, hidden=c.hidden_size,
                                         heads=c.num_attention_heads, vocab=c.vocab_size,
                                         kv_heads=c.num_key_value_heads, ffn=c.intermediate_size,
                                         seq=c.max_position_embeddings)
    model = _loads_with_the_same_loss(tmp_path, cfg, hf)
    exported = name_map(model).to_hf_state(dict(model.named_parameters()))
    for name, value in hf.model.state_dict().items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)


def test_fxpar_gpt_loads_a_hugging_face_gpt2(tmp_path):
    hf = _hf_dir(tmp_path, "gpt2", activation_function="gelu")
    c = hf.model.config
    cfg = get_config("gpt-tiny").with_(layers=c.n_layer, hidden=c.n_embd, heads=c.n_head,
                                       vocab=c.vocab_size, seq=c.n_positions, tie=True)
    model = _loads_with_the_same_loss(tmp_path, cfg, hf)
    names = name_map(model)
    assert names.to_hf("blocks.0.attn.qkv.weight") == HFTensor("transformer.h.0.attn.c_attn.weight",
                                                               transpose=True)
    assert names.from_hf("transformer.wte.weight") == "wte.weight"
    assert names.aliases == ("lm_head.weight",)


def test_sharded_checkpoint_with_index(tmp_path):
    hf = _hf_dir(tmp_path / "one", "llama")
    hf.model.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "many" / "model.safetensors.index.json")
    files = {f for _, f, _ in open_checkpoint(str(tmp_path / "many")).tensors}
    assert len(files) > 1
    model = hf_model(str(tmp_path / "many"))
    with ShardReader(str(tmp_path / "many"), model) as reader:
        model = materialize_full(model, source=reader)
    for name, value in hf.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], value, rtol=0, atol=0)


def test_bad_checkpoints_name_the_tensor_the_file_and_the_shape(tmp_path):
    hf = _hf_dir(tmp_path / "good", "llama")
    state = {k: v.contiguous() for k, v in hf.model.state_dict().items()}
    model = hf_model(str(tmp_path / "good"))

    def write(folder, tensors):
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        return str(folder)
    missing = write(tmp_path / "missing", {k: v for k, v in state.items()
                                           if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(WeightsError, match=r"missing/model.safetensors: no tensor "
                       r"model.layers.1.mlp.up_proj.weight \(expected shape \[128, 64\]"):
        ShardReader(missing, model)
    extra = write(tmp_path / "extra", {**state, "model.layers.9.bias": torch.zeros(3)})
    with pytest.raises(WeightsError, match=r"extra/model.safetensors: tensor model.layers.9.bias "
                       r"\(shape \[3\]\) is not a parameter"):
        ShardReader(extra, model)
    bad = write(tmp_path / "bad", {**state, "model.norm.weight": torch.ones(65)})
    with pytest.raises(WeightsError, match=r"bad/model.safetensors: tensor model.norm.weight "
                       r"has shape \[65\], expected \[64\]"):
        ShardReader(bad, model)
    with pytest.raises(WeightsError, match="holds neither model.safetensors nor"):
        os.makedirs(tmp_path / "empty")
        ShardReader(str(tmp_path / "empty"), model)
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "model.safetensors.index.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(WeightsError, match="not a safetensors index with a weight_map"):
        ShardReader(str(tmp_path / "idx"), model)
    with pytest.raises(WeightsError, match="does not exist"):
        ShardReader(str(tmp_path / "nowhere"), model)


def test_run_weights_refuses_what_it_would_ignore(tmp_path, capsys):
    from planner.cli import main
    assert main(["run", "--weights", str(tmp_path / "nowhere"), "--gpus", "2"]) == 2
    assert "weights directory" in capsys.readouterr().err
    assert main(["run", "--weights", str(tmp_path), "--gpus", "2", "--layers", "3"]) == 2
    assert "takes the model and its sizes from" in capsys.readouterr().err
    assert main(["run", "--weights", str(tmp_path), "--gpus", "2"]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["cp", "uneven-gqa"])
def test_tables_a_rewrite_makes_on_a_meta_model_keep_their_values(case):
    """Context parallelism's position table and the kv-head index of unevenly grouped heads
    (12 query heads, 3 kv heads, tp=2), made on the meta device, get the values the same rewrite
    of a model with real weights has."""
    if case == "cp":
        cfg, name = get_config("gpt-tiny").with_(layers=2), "cp_positions"
    else:
        cfg, name = get_config("llama-tiny").with_(layers=2, heads=12, kv_heads=3, hidden=96), \
            "_heads"
    tokens = example_batch(cfg, 1)
    for rank in range(2):
        tables = []
        for device in ("meta", "cpu"):
            model = build_model(cfg, device=device)
            captured = capture(model, tuple(t.to(device) for t in tokens))
            layout = (Layout(1, (), (2, 2), cp=2) if case == "cp" else
                      Layout(2, tuple((b.name, "tp") for b in captured.blocks), (2, 2)))
            programs = (rank_programs(captured, layout, 0, (0, 1), rank) if case == "cp" else
                        rank_programs(captured, layout, rank, (0, 1)))
            if device == "meta":
                materialize_programs(programs.values(), model, {}, init_source(model))
            tables.append({n: b for p in programs.values() for n, b in p.gm.named_buffers()})
        assert any(n.endswith(name) for n in tables[1]), sorted(tables[1])
        for n, value in tables[1].items():
            torch.testing.assert_close(tables[0][n], value, rtol=0, atol=0)
