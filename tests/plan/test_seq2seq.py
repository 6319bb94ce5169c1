"""Encoder-decoder Hugging Face models (planner.models.hf_seq2seq), planned without ranks: each
family captures as one chain of the encoder's blocks then the decoder's, tensor parallelism reads
T5's relative position bias per rank, pipeline stages carry the encoder's output to every decoder
stage and price it, T5 plans from its config.json through the command line, and a Flan-T5-XL-sized
config plans on 64 H100s on the meta device."""
import json
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cost_model.layers.layer_cost import profile_layer  # noqa: E402
from passes.capture.trace import capture, tensor_bytes  # noqa: E402
from passes.stages.pipeline_split import split_stages, stage_assignment  # noqa: E402
from planner.api import plan  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.models.hf import build_hf, build_hf_from_file, example_inputs  # noqa: E402
from planner.models.hf_seq2seq import (FAMILIES, HFSeq2SeqLM, HFSeq2SeqSpec,  # noqa: E402
                                       small_seq2seq_config)
from planner.search.costs import ModelCosts, PlanningError  # noqa: E402
from runtime.comm import collectives  # noqa: E402

IDS = [f.arch + ("-" + dict(f.overrides).get("feed_forward_proj", "") if
                  "feed_forward_proj" in dict(f.overrides) else "") for f in FAMILIES]


def _captured(spec: HFSeq2SeqSpec):
    torch.manual_seed(0)
    model, batch = spec.build()
    return model, batch, capture(model, tuple(x[:1] for x in batch))


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_each_family_is_one_chain_of_encoder_then_decoder_blocks_and_shards(family):
    """torch.export captures the family (the decoder's tokens given, no shift inside the graph);
    its blocks run encoder first, then decoder, each a layer of the chain; tp=2 rewrites every
    kind of block."""
    _, _, captured = _captured(HFSeq2SeqSpec(family.arch, 2, family.overrides, seq=16))
    assert captured.method == "export"
    names = [layer.name for layer in captured.layers]
    assert names[0] == "embed" and names[-1] == "head" and len(captured.parts) == 2
    encoder, decoder = captured.parts
    assert "encoder" in encoder and "decoder" in decoder
    assert names[1:-1] == [f"{encoder}.0", f"{encoder}.1", f"{decoder}.0", f"{decoder}.1"]
    costs = ModelCosts(captured, len(captured.blocks), 4)
    assert costs.block_profile(2) is not None, costs.tp_errors.get(2)
    assert all(costs.block_profile(2, k) is not None for k in range(len(costs.kinds)))


def test_t5s_position_bias_is_read_per_rank_through_tp_copy():
    """T5's first block makes the bias [1, heads, q, k] from a trained embedding and every block
    reads it; under tp=2 each block reads it through tp_copy (its gradient all-reduced backward:
    priced as [1, heads, q, k] fp32 of the rank's whole bias) and takes its 4 of the 8 heads."""
    _, _, captured = _captured(HFSeq2SeqSpec("t5", 2, (("d_kv", 16),), seq=16))
    for block in captured.blocks:
        profile = profile_layer(captured, block, 2)
        bias_grads = [c for c in profile.collectives
                      if c.phase == "bwd" and c.nbytes == 4 * 8 * 16 * 16]
        assert bias_grads, (block.name, profile.collectives)
    layer = captured.blocks[0]
    from passes.stages.program import Layout, rank_programs
    layout = Layout(2, tuple((b.name, "tp") for b in captured.blocks), (len(captured.layers),))
    program = rank_programs(captured, layout, 1, (0,))[0]
    copies = [n for n in program.gm.graph.nodes if n.target is collectives.tp_copy
              and n.meta["val"].dim() == 4 and n.meta["val"].shape[1] == 8]
    taken = [n for n in program.gm.graph.nodes if n.target is torch.narrow
             and n.args[0].target is torch.unflatten and n.args[2:] == (4, 4)]
    assert len(copies) >= 4 and len(taken) >= 4, layer.name  # rank 1: heads 4..7


def test_the_encoder_output_crosses_every_decoder_stage_and_is_priced():
    """pp=4 over embed + 2 encoder blocks, 3 decoder blocks, head: the encoder's output is sent
    across every boundary from the last encoder block's stage to the last decoder block's, and the
    bytes a boundary is priced at cover the most any boundary sends."""
    spec = HFSeq2SeqSpec("t5", 2, (("num_decoder_layers", 3),), seq=16)
    _, _, captured = _captured(spec)
    names = [layer.name for layer in captured.layers]
    assert names == ["embed", "model.encoder.block.0", "model.encoder.block.1",
                     "model.decoder.block.0", "model.decoder.block.1", "model.decoder.block.2",
                     "head"]
    layers = {layer.name: layer.nodes for layer in captured.layers}
    sizes = [3, 1, 1, 2]  # the encoder on stage 0, a decoder block or two on each other one
    stages = split_stages(captured.gm, stage_assignment(layers, names, sizes), len(sizes))
    encoder_out = _encoder_output(captured)
    assert encoder_out not in layers["model.encoder.block.0"]
    for stage in stages[1:]:  # every stage after the encoder's receives it
        assert stage.boundary_inputs.count(encoder_out) == 1, stage.stage
    costs = ModelCosts(captured, len(captured.blocks), 4)
    sent = [sum(tensor_bytes(torch.empty(s.shape, dtype=s.dtype, device="meta"))
                for s in stage.output_specs) for stage in stages[:-1]]
    hidden = 16 * 64 * 4
    assert costs.carried_bytes >= hidden  # the encoder output, past decoder blocks
    assert costs.boundary_bytes(1) >= max(sent)
    # past decoder block 1: the decoder's position bias [1, heads, q, k], made in its block 0
    # from a trained embedding and aranges, the same for every sample: counted once, not per
    # sample of the micro-batch as the encoder's output is
    past = costs._carried[names.index("model.decoder.block.1")]
    assert past[1] >= 8 * 16 * 16 * 4 and past[0] >= hidden, past


def _encoder_output(captured) -> str:
    """The value the decoder's cross-attention keys and values are computed from: made by the
    encoder's last block (its final norm goes with it) and read by every decoder block."""
    layer_of = captured.layer_of()
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    made = captured.blocks[1].nodes
    readers = {layer_of.get(u.name) for name in made for u in nodes[name].users}
    found = [name for name in made
             if {layer_of.get(u.name) for u in nodes[name].users} >= {
                 "model.decoder.block.0", "model.decoder.block.1", "model.decoder.block.2"}]
    assert len(found) == 1, readers
    return found[0]


def test_plans_from_its_config_file_through_the_command_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    small_seq2seq_config("t5").to_json_file(str(path))
    assert main(["plan", "--hf-config", str(path), "--gpus", "4", "--cluster", "cpu-gloo",
                 "--global-batch", "8", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    mesh = planned["mesh"]
    assert mesh["dp"] * mesh["tp"] * mesh["pp"] * mesh.get("cp", 1) == 4
    assert planned["model"] == "T5ForConditionalGeneration"
    assert sum(len(s["layers"]) for s in planned["stages"]) == 2 + 2 + 2
    note = next(n for n in planned["notes"] if n.startswith("encoder-decoder"))
    assert "encoder reads 32 tokens" in note and "the decoder 32 (as many as the encoder's" in note


def test_plans_with_t5_under_hf_and_its_sizes(capsys):
    assert main(["plan", "--hf", "t5", "--layers", "3", "--gpus", "2", "--cluster", "cpu-gloo",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert sum(len(s["layers"]) for s in planned["stages"]) == 3 + 3 + 2


def test_flan_t5_xl_plans_on_64_h100s_without_weights(tmp_path):
    """Flan-T5-XL's config (d_model 2048, 32 heads of 64, gated-GELU 5120, 24 + 24 blocks,
    untied head), built on the meta device: planned in seconds with pp=4 fixed, decoder blocks on
    several stages, and each boundary priced with the encoder's output it carries."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "t5", "d_model": 2048, "d_kv": 64, "d_ff": 5120, "num_heads": 32,
        "num_layers": 24, "num_decoder_layers": 24, "feed_forward_proj": "gated-gelu",
        "vocab_size": 32128, "n_positions": 512, "tie_word_embeddings": False,
        "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
        "dropout_rate": 0.1, "decoder_start_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 0}))
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_hf_from_file(str(path))
    assert isinstance(model, HFSeq2SeqLM)
    assert all(p.is_meta for p in model.parameters())
    inputs = example_inputs(model, 256, 512)
    chosen = plan(model, 64, inputs, cluster="h100-sxm-dgx", fix={"pp": 4})[0]
    seconds = time.perf_counter() - start
    assert 2.7e9 < chosen.params < 3.0e9
    assert chosen.pp == 4 and chosen.seq == 512
    decoder_stages = {s for s, stage in enumerate(chosen.stages)
                      if any("decoder.block" in layer for layer in stage.layers)}
    assert len(decoder_stages) >= 2, [stage.layers for stage in chosen.stages]
    assert any("the decoder 512" in note for note in chosen.notes)
    assert seconds < 90, f"planned in {seconds:.0f} s"


def test_context_parallel_needs_equal_lengths_and_no_learned_position_bias():
    """BART's cross-attention rings over the encoder's tokens when the decoder reads as many;
    a shorter decoder, or T5's bias made from a trained embedding, is refused with the reason."""
    fix = {"cp": 2, "pp": 2, "tp": 1, "dp": 1, "mb": 2, "schedule": "1f1b"}
    model, batch = HFSeq2SeqSpec("bart", 8, seq=16).build()
    assert plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0].cp == 2
    model, batch = HFSeq2SeqSpec("bart", 8, seq=16, decoder_seq=8).build()
    with pytest.raises(PlanningError, match="holds 8 tokens per sample and the first input 16"):
        plan(model, 4, batch, cluster="cpu-gloo", fix=fix)
    model, batch = HFSeq2SeqSpec("t5", 8, seq=16).build()
    with pytest.raises(PlanningError, match="relative_attention_bias"):
        plan(model, 4, batch, cluster="cpu-gloo", fix=fix)


@pytest.mark.parametrize("arch, fields, message", [
    ("t5", {"num_key_value_heads": 2}, "t5 has no config field 'num_key_value_heads'"),
    ("bart", {"decoder_layer": 3}, "did you mean 'decoder_layers'"),
    ("t6", {}, "unknown encoder-decoder architecture 't6'"),
    ("m2m_100", {"encoder_layerdrop": 0.1}, "encoder_layerdrop=0.1: layerdrop skips whole"),
])
def test_bad_configs_are_one_line_errors(arch, fields, message):
    with pytest.raises(ValueError, match=message) as err:
        build_hf(arch, **fields) if arch != "t6" else small_seq2seq_config(arch)
    assert "\n" not in str(err.value)


def test_small_configs_set_both_sides():
    t5 = small_seq2seq_config("t5", num_hidden_layers=3)
    assert (t5.num_layers, t5.num_decoder_layers, t5.d_model, t5.d_kv, t5.n_positions) == \
        (3, 3, 64, 8, 32)
    bart = small_seq2seq_config("bart", decoder_layers=1)
    assert (bart.encoder_layers, bart.decoder_layers, bart.encoder_attention_heads,
            bart.decoder_ffn_dim, bart.dropout) == (2, 1, 8, 128, 0.0)
    marian = small_seq2seq_config("marian")
    assert marian.pad_token_id < marian.vocab_size and marian.decoder_vocab_size == 256


def test_prophetnet_defaults_to_the_tokens_its_positions_hold():
    """Its positions start after the padding id and its decoder's predicting stream reads one
    further: of 32 positions 30 tokens run; more are refused naming the length to give."""
    from planner.models.hf_seq2seq import sequence_length
    torch.manual_seed(0)
    model = build_hf("prophetnet")
    assert sequence_length(model) == 30
    assert sequence_length(build_hf("bart")) == 32  # its offset of 2 is built into the table
    model(*model.example_inputs(2, 30))
    with pytest.raises(ValueError, match="prophetnet reads at most 30 tokens .* --seq 30") as err:
        model.example_inputs(2, 32)
    assert "\n" not in str(err.value)


def test_a_capture_failure_keeps_torch_fx_s_cause_not_its_docs_pointer():
    from passes.capture.capture_errors import clean as _clean
    fx_error = ("Proxy object cannot be iterated. This can be attempted when the Proxy is used "
                "in a loop or as a *args or **kwargs function argument. See the torch.fx docs "
                "on pytorch.org for a more detailed explanation")
    assert _clean(fx_error) == "Proxy object cannot be iterated"
