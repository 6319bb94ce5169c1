"""Rotary embeddings that transformers updates in forward (longrope, dynamic NTK) are captured
with the frequencies of the captured sequence length, fixed (planner.models.hf_rope): the graph
writes no buffer and reads no position to choose them, and its loss is transformers' own in one
process, below and above the length where the frequencies change. YaRN is static already."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from passes.capture.trace import capture  # noqa: E402
from planner.models import hf_rope  # noqa: E402
from planner.models.hf import build_hf  # noqa: E402

LIMIT = 16  # where each case's frequencies change: original (longrope) or maximum positions
CASES = {
    "phi3-longrope": ("phi3", dict(
        max_position_embeddings=4 * LIMIT, original_max_position_embeddings=LIMIT,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                      "long_factor": [1.0, 3.0, 6.0, 12.0]})),
    "llama-dynamic": ("llama", dict(max_position_embeddings=LIMIT,
                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # frequencies per layer type, the full layers' updated
    "gemma3-layer-types": ("gemma3_text", dict(
        max_position_embeddings=LIMIT, head_dim=4,
        layer_types=["full_attention", "sliding_attention"], rope_parameters={
            "full_attention": {"rope_type": "longrope", "rope_theta": 1e4,
                               "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0],
                               "original_max_position_embeddings": LIMIT},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "qwen2-yarn": ("qwen2", dict(max_position_embeddings=4 * LIMIT, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": LIMIT})),
}
SEQS = [LIMIT // 2, LIMIT, 2 * LIMIT]


def _build(case: str, device="cpu"):
    arch, overrides = CASES[case]
    torch.manual_seed(0)
    with torch.device(device):
        return build_hf(arch, **overrides)


def _batch(seq: int):
    gen = torch.Generator().manual_seed(seq)
    return tuple(torch.randint(0, 256, (2, seq), generator=gen) for _ in "xy")


def _transformers_loss(hf_model, tokens, targets):
    """transformers' own forward in one process (its rope update included)."""
    logits = hf_model(input_ids=tokens, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("case", list(CASES))
def test_captured_loss_is_transformers_own(case, seq):
    model = _build(case)
    reference = copy.deepcopy(model.model)
    tokens, targets = _batch(seq)
    want = _transformers_loss(reference, tokens, targets)
    captured = capture(model, (tokens, targets))
    torch.testing.assert_close(captured.gm(tokens, targets), want, rtol=0, atol=0)
    torch.testing.assert_close(model(tokens, targets), want, rtol=0, atol=0)  # eager, fxpar's
    # chosen by the captured length, not by the largest position (transformers' torch.max): a
    # context-parallel rank holds some of the positions only
    reductions = {torch.ops.aten.max.default, torch.ops.aten.amax.default}
    assert not any(n.target in reductions for n in captured.gm.graph.nodes)


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("case", ["phi3-longrope", "llama-dynamic"])
def test_the_frequencies_are_those_transformers_update_to(case, seq):
    model = _build(case)
    rotary = model.model.model.rotary_emb
    reference = copy.deepcopy(model.model)
    _transformers_loss(reference, *_batch(seq))
    updated = reference.model.rotary_emb
    got, _ = hf_rope.frequencies(rotary, None, rotary.rope_type, seq)
    assert torch.equal(got, updated.inv_freq)
    # below and at the limit the built ones, above it others
    assert torch.equal(got, rotary.original_inv_freq) == (seq <= LIMIT)


@pytest.mark.parametrize("case", ["phi3-longrope", "llama-dynamic"])
def test_the_model_is_left_as_transformers_built_it(case):
    model = _build(case)
    rotary = model.model.model.rotary_emb
    kind, inv_freq, cached = rotary.rope_type, rotary.inv_freq, rotary.max_seq_len_cached
    capture(model, _batch(2 * LIMIT))
    assert (rotary.rope_type, rotary.max_seq_len_cached) == (kind, cached)
    assert rotary.inv_freq is inv_freq
    assert "long_inv_freq" not in vars(rotary)  # transformers' update never ran


@pytest.mark.parametrize("case", ["phi3-longrope", "llama-dynamic"])
def test_a_meta_model_materialises_the_same_frequencies(case):
    """The graph of a meta model reads only values materialisation gives (no meta constant)."""
    from planner.weights.materialize import init_source, materialize_full, materialize_programs
    meta = _build(case, device="meta")
    pristine = copy.deepcopy(meta)
    tokens, targets = _batch(2 * LIMIT)
    captured = capture(meta, (tokens.to("meta"), targets.to("meta")))
    program = types.SimpleNamespace(gm=captured.gm, stage=0)
    materialize_programs([program], pristine, {}, init_source(pristine), "cpu")
    full = materialize_full(copy.deepcopy(pristine))
    want = _transformers_loss(full.model, tokens, targets)
    torch.testing.assert_close(captured.gm(tokens, targets), want, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:The tensor attribute")  # transformers' update, traced
def test_given_positions_still_refused():
    """The model itself given position ids (packed sequences) chooses from their values, which
    differ between micro-batches: transformers' update is traced, and refused."""
    from passes.capture.trace import CaptureError
    from planner.models.loss import causal_lm_loss, with_loss
    model = _build("phi3-longrope")
    tokens, targets = _batch(LIMIT)
    positions = torch.arange(LIMIT).expand(2, LIMIT).contiguous()
    wrapped = with_loss(model.model, causal_lm_loss)
    with pytest.raises(CaptureError, match="rotary_emb.inv_freq"):
        capture(wrapped, (tokens, positions, targets))
