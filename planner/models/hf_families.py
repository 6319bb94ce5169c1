"""Decoder-only Hugging Face families at small sizes, and what each one exercises.

One small config per transformers model_type (planner.models.hf.small_config: 2 layers, hidden 64, 8
heads, vocabulary 256, 32 positions, dropout off), with the few fields that make it exercise a
construct of its family: a sliding window shorter than the sequence, one kv head, post-norm.
Nothing here is read by the planner — it plans every family through the same capture — it is the
coverage list of tests/dist/test_hf_families.py and examples/hf_families.py.

`refuses` names the parallel axes the family cannot use ("sp": sequence parallel, under tp) and a
phrase of the reason the planner gives (its `--fix` is refused with it; the search leaves the axis
out).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    arch: str                                        # transformers model_type
    exercises: str
    overrides: tuple[tuple[str, object], ...] = ()
    refuses: tuple[tuple[str, str], ...] = field(default=())  # (axis, phrase of the reason)

    def refusal(self, axis: str) -> str | None:
        return dict(self.refuses).get(axis)


FAMILIES = (
    Family("gpt2", "tied embeddings, learned absolute positions, LayerNorm, GELU, biases "
           "everywhere, fused QKV (Conv1D)"),
    Family("llama", "RMSNorm, SwiGLU, rotary, GQA (8 query / 4 kv heads)"),
    Family("gemma2", "sliding-window attention alternating with global, attention and final "
           "logit soft-capping, Gemma-2 extra norms (pre- and post-norm), tied embeddings, "
           "GeGLU, eager attention", (("sliding_window", 8),),
           refuses=(("cp", "no attention to ring"),)),
    Family("gemma3_text", "sliding window alternating with global (pattern 2; under cp: each "
           "rank's query rows of the whole mask), per-head q/k RMSNorm (1 + weight)",
           (("sliding_window", 8), ("sliding_window_pattern", 2))),
    Family("qwen3", "per-head q/k RMSNorm, GQA"),
    Family("gptj", "parallel attention + MLP, partial interleaved rotary (rotary_dim 4 of 8)"),
    Family("starcoder2", "MQA (one kv head), biases everywhere, LayerNorm, GELU",
           (("num_key_value_heads", 1),)),
    Family("granite", "embedding, residual, attention and logit multipliers"),
    Family("cohere", "parallel block, interleaved rotary, logit scale, tied embeddings"),
    Family("stablelm", "partial rotary, LayerNorm"),
    Family("opt", "learned positions with an offset of 2 (counted by a cumulative sum over the "
           "sequence; under cp read at each rank's tokens), post-norm, ReLU, biases",
           (("do_layer_norm_before", False),),
           (("sp", r"the sequence \(dim 1\) changed"),)),  # [batch x seq, hidden] MLP input
    Family("falcon", "parallel attention + MLP, fused QKV of interleaved heads, LayerNorm, "
           "projections written x @ w.T", (("multi_query", False),)),
    Family("phi", "parallel attention + MLP, partial rotary, biases, GELU"),
    Family("gpt_neox", "parallel residual, partial rotary, fused QKV"),
    Family("mistral", "sliding-window attention on every layer", (("sliding_window", 8),)),
    Family("qwen2", "biases on q/k/v only, GQA"),
    Family("olmo2", "post-norm (norms after attention and MLP), q/k RMSNorm over all heads "
           "(under tp: a distributed RMSNorm, its statistics all-reduced)"),
    Family("bloom", "ALiBi (under tp: each rank's heads of the bias), LayerNorm after the "
           "embedding, fused QKV", refuses=(("cp", "no attention to ring"),)),
    Family("gpt_bigcode", "MQA fused into the QKV projection (under tp: kept whole, each rank "
           "taking its query heads and the one kv head from the parts of its split)"),
    Family("xglm", "sinusoidal positions with an offset, scaled embeddings, eager attention "
           "clamped by an elementwise torch.max, heads merged with the batch (which one "
           "sample's capture cannot show: tp refused as two samples' shows it)",
           refuses=(("tp", "multiplies values whose sharded dimension holds different merged"),
                    ("cp", "no attention to ring"))),
    Family("codegen", "fused QKV laid out per model-parallel group (viewed as (4, 3 x width) "
           "and split: under tp each rank holds whole groups), parallel attention + MLP, "
           "partial interleaved rotary"),
    Family("phi3", "fused QKV read as slices of unequal parts (q beside fewer kv heads; under "
           "tp each part cut apart), fused gate/up chunked"),
    Family("apertus", "xIELU activation (branches chosen by a comparison), q/k RMSNorm, "
           "a non-gated MLP"),
)
BY_ARCH = {f.arch: f for f in FAMILIES}
