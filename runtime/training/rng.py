"""Random numbers per rank for dropout, as Megatron-LM's RNG tracker keeps them.

Two streams on every rank:

* the default generator, seeded alike on the ranks of one tensor-parallel group and differently
  across pipeline stages, data-parallel replicas and context-parallel ranks: a dropout of a
  value every tp rank holds whole (after a row-parallel all-reduce, in the embedding) drops the
  same elements on each, so the replicas stay equal;
* a tensor-parallel stream, seeded differently on every tp rank, which `tp_dropout` draws from:
  a dropout of a sharded value (attention probabilities of this rank's heads, the MLP's inner
  features) drops independently per shard, as one process dropping the whole tensor would.

Under activation checkpointing the tp stream replays like the default generator does
(`StreamReplay`, used by passes.rewrite.recompute), so a recomputed region drops what its forward dropped.

`seed_ranks` sets both at set-up (runtime.training.trainer calls it); passes.rewrite.tensor_parallel turns each
dropout of a sharded value into `tp_dropout`, and an sdpa of sharded heads that drops into
`tp_scaled_dot_product_attention` (its fused dropout drawn from the tp stream). The dropped elements differ from a one-process run
(that draws one stream over the whole batch), so a run with dropout matches one process in
distribution, not bit for bit; with p = 0 nothing is drawn and the numerics are unchanged.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_TP_OFFSET = 2718  # Megatron's offset of the model-parallel seed
_STATE: dict[str, torch.Generator] = {}
_CUDA: dict[int, torch.Tensor] = {}   # the tp stream's state on each CUDA device, once used


def seed_ranks(seed: int, tp_index: int, pp_index: int = 0, dp_index: int = 0,
               cp_index: int = 0) -> None:
    """Seed the default generator by everything but the tp index, the tp stream by it too."""
    replica = seed + 100_003 * pp_index + 1_009 * dp_index + 10_007 * cp_index
    torch.manual_seed(replica)
    gen = torch.Generator()
    gen.manual_seed(replica + _TP_OFFSET + 7 * (tp_index + 1))
    _STATE["tp"] = gen
    _CUDA.clear()


def shared_seed() -> int:
    """Global rank 0's initial seed, on every rank (ranks need not be seeded alike)."""
    import torch.distributed as dist
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed)


def tp_generator() -> torch.Generator:
    """The tensor-parallel stream (seeded from torch's initial seed when never set up)."""
    if "tp" not in _STATE:
        gen = torch.Generator()
        gen.manual_seed(torch.initial_seed() + _TP_OFFSET)
        _STATE["tp"] = gen
    return _STATE["tp"]


def tp_dropout(x: torch.Tensor, p: float = 0.5, train: bool = True, tag: str = "") -> torch.Tensor:
    """Dropout of a tensor-parallel shard, drawn from this rank's own stream."""
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = torch.empty(x.shape, dtype=x.dtype, device="cpu").bernoulli_(1.0 - p,
                                                                        generator=tp_generator())
    return x * keep.to(x.device) / (1.0 - p)


def tp_scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                    is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention of this rank's heads, whose fused dropout draws from the
    tensor-parallel stream: the default generator takes the stream's state for the call (the
    kernel draws from it; backward reuses what forward drew) and gets its own state back."""
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kwargs = {"scale": scale, "enable_gqa": enable_gqa}
    if not dropout_p or query.is_meta or type(query).__name__ == "FakeTensor":
        return F.scaled_dot_product_attention(*args, **kwargs)
    with _tp_stream_as_default(query.device):
        return F.scaled_dot_product_attention(*args, **kwargs)


@contextlib.contextmanager
def _tp_stream_as_default(device: torch.device):
    cuda = device.type == "cuda"
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if cuda else 0)
    get = (lambda: torch.cuda.get_rng_state(index)) if cuda else torch.get_rng_state
    put = (lambda state: torch.cuda.set_rng_state(state, index)) if cuda else torch.set_rng_state
    own = get()
    if cuda:
        if index not in _CUDA:  # the stream on this device, seeded from the CPU stream's seed
            torch.cuda.default_generators[index].manual_seed(tp_generator().initial_seed())
            _CUDA[index] = get()
        put(_CUDA[index])
    else:
        put(tp_generator().get_state())
    try:
        yield
    finally:
        if cuda:
            _CUDA[index] = get()
        else:
            tp_generator().set_state(get())
        put(own)


def _stream_state():
    return tp_generator().get_state(), dict(_CUDA)


def _set_stream_state(state) -> None:
    tp_generator().set_state(state[0])
    _CUDA.clear()
    _CUDA.update(state[1])


class StreamReplay:
    """The tensor-parallel stream through one activation checkpoint, as torch.utils.checkpoint
    keeps the default generator: entering `forward()` records the stream's state; entering
    `recompute()` draws from that state again (the recomputed dropout masks equal the forward's)
    and on exit puts the stream back where it was, so later draws are unaffected. Both are
    re-enterable: a checkpoint recomputes once per backward pass (twice when input and weight
    gradients are computed apart)."""

    def __init__(self):
        self._state: torch.Tensor | None = None

    def forward(self) -> _Record:
        return _Record(self)

    def recompute(self) -> _Replay:
        return _Replay(self)


class _Record:
    def __init__(self, replay: StreamReplay):
        self.replay = replay

    def __enter__(self):
        self.replay._state = _stream_state()

    def __exit__(self, *exc):
        return None


class _Replay:
    def __init__(self, replay: StreamReplay):
        self.replay, self.now = replay, []

    def __enter__(self):
        self.now.append(_stream_state())
        if self.replay._state is not None:
            _set_stream_state(self.replay._state)

    def __exit__(self, *exc):
        _set_stream_state(self.now.pop())
