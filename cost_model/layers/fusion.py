"""What a pointwise op moves through memory when chains of pointwise ops run as one kernel.

torch.compile (Inductor) and Transformer Engine's fused kernels run a chain of pointwise ops — an
RMSNorm's cast, square, mean, rsqrt and scale, RoPE's multiplies and adds, SwiGLU, a residual
add — as one kernel whose intermediate tensors stay in registers. An op in a chain then reads
only the tensors that come from outside every chain (a matmul's or attention's output, a
parameter, the layer's input) and writes its output only when something outside the chains
consumes it (a matmul, attention, a collective, the layer's output). Views pass a tensor on
without a kernel, so chains are followed through them. Norms join the chains: their reduction
runs along the last dimension inside one kernel's rows, as Inductor's and TE's norm kernels do.
An op whose reads and writes all stay inside its chain moves nothing and is priced at nothing:
its work is done by the kernel of the chain.

Backward is taken to fuse in the same proportion (each op's backward bytes scale by its fused
share of the forward's), which is what Inductor's backward graph of a fused chain does.
"""
from __future__ import annotations

import torch.fx as fx

FUSIBLE = ("elementwise", "norm")


def fused_bytes(gm: fx.GraphModule, classes: dict[str, str]) -> dict[str, float]:
    """Forward bytes each pointwise node of gm moves when fused (classes: node name -> op
    class of cost_model.hardware.compute.OP_CLASSES; a node without one is no pointwise op)."""
    def fusible(node: fx.Node) -> bool:
        return classes.get(node.name) in FUSIBLE

    def source(node: fx.Node) -> fx.Node:  # through views, the node that wrote the tensor
        while classes.get(node.name) == "view" and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    def consumers(node: fx.Node) -> list[fx.Node]:  # through views
        return [c for u in node.users
                for c in (consumers(u) if classes.get(u.name) == "view" else [u])]

    moved = {}
    for node in gm.graph.nodes:
        if not fusible(node):
            continue
        reads = sum(_bytes(a) for a in node.all_input_nodes if not fusible(source(a)))
        escapes = any(not fusible(c) for c in consumers(node))
        moved[node.name] = reads + (_bytes(node) if escapes else 0.0)
    return moved


def _bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    return float(val.numel() * val.element_size()) if hasattr(val, "numel") else 0.0
