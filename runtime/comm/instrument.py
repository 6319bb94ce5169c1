"""Run-time counters per layer, on this rank: bytes each collective kind sends, and bytes of the
tensors autograd keeps for backward.

Communication: every collective of `runtime.comm.collectives` adds the bytes it sends to
collectives.TRAFFIC under (kind, layer), with `runtime.comm.wire.bytes_on_wire` semantics, so the
numbers compare exactly with `cost_model.layers.layer_cost.price(...).comm_bytes`. Communication repeated to
save memory (recomputation, the re-gather of a sequence-parallel linear) goes to RECOMPUTE_TRAFFIC.
`counting()` resets both and hands back what ran inside it, per layer.

Saved for backward: `saved_bytes(gm, *inputs)` runs a graph's forward node by node under
torch.autograd.graph.saved_tensors_hooks and charges each saved tensor to the layer of the node that
saved it (node.meta["fxpar_layer"]). Whole storages are counted, each once (a saved view keeps all of
its storage alive); parameters, buffers and non-floating inputs (token ids) are not. The inputs a
checkpointed region keeps are counted through `note_kept` (its own saves are dropped by design).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from runtime.comm import collectives

LAYER = "fxpar_layer"  # the node meta key the rewrite passes tag every node with


@dataclass
class Traffic:
    """Bytes sent per (kind, layer): `sent` as priced, `repeated` recomputed/re-gathered."""

    sent: dict[tuple[str, str], float] = field(default_factory=dict)
    repeated: dict[tuple[str, str], float] = field(default_factory=dict)

    def layer(self, name: str, repeated: bool = False) -> dict[str, float]:
        """kind -> bytes for one layer."""
        table = self.repeated if repeated else self.sent
        return {kind: b for (kind, tag), b in sorted(table.items()) if tag == name and b}


@contextlib.contextmanager
def counting():
    """Reset the traffic counters; on exit the Traffic yielded holds what ran inside."""
    result = Traffic()
    collectives.TRAFFIC.clear()
    collectives.RECOMPUTE_TRAFFIC.clear()
    try:
        yield result
    finally:
        result.sent = dict(collectives.TRAFFIC)
        result.repeated = dict(collectives.RECOMPUTE_TRAFFIC)


class _Recorder:
    """Charges each storage saved for backward once, to the layer current when it is saved."""

    def __init__(self, module: torch.nn.Module, inputs):
        excluded = [*module.parameters(), *module.buffers(),
                    *(x for x in inputs if isinstance(x, torch.Tensor) and
                      not x.is_floating_point())]
        self.seen = {self._key(t) for t in excluded}
        self.per_layer: dict[str, int] = defaultdict(int)
        self.layer = "?"

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        key = self._key(t)
        if key not in self.seen and t.device.type != "meta":
            self.seen.add(key)
            self.per_layer[self.layer] += t.untyped_storage().nbytes()
        return t


_ACTIVE: list[_Recorder] = []


def note_kept(tensors) -> None:
    """Tensors held for backward outside autograd's saved tensors (a checkpoint's inputs)."""
    if _ACTIVE:
        for t in tensors:
            _ACTIVE[-1].keep(t)


class _ByLayer(fx.Interpreter):
    def __init__(self, gm, recorder: _Recorder):
        super().__init__(gm)
        self.recorder = recorder

    def run_node(self, n: fx.Node):
        self.recorder.layer = n.meta.get(LAYER, "?")
        return super().run_node(n)


def saved_bytes(gm: fx.GraphModule, *inputs) -> tuple[object, dict[str, int]]:
    """Run gm(*inputs) (autograd on) and return (its output, saved-for-backward bytes per layer).
    The output can be back-propagated as usual."""
    recorder = _Recorder(gm, inputs)
    _ACTIVE.append(recorder)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.keep, lambda t: t):
            out = _ByLayer(gm, recorder).run(*inputs)
    finally:
        _ACTIVE.pop()
    return out, dict(recorder.per_layer)
