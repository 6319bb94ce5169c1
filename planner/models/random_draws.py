"""The random numbers a model draws in its forward, said in the plan.

Each rank draws its own (runtime/training/rng.py: one stream per data-parallel, pipeline and
context-parallel rank, and a stream per tensor-parallel rank for a sharded value's dropout), so
wherever a model draws - dropout, or sampling of its own (Phi-3.5-MoE's router samples its
experts: exponential_ and rand_like) - parallel training matches one process in distribution,
not bit for bit. The plan says which draws, where, and how to compare runs exactly.
"""
from __future__ import annotations

from cost_model.ops import graph_facts as op_graph

# Ops that draw from a generator (in-place variants are named without their "_")
_DRAWS = frozenset({"rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
                    "randperm", "bernoulli", "multinomial", "normal", "uniform", "exponential",
                    "geometric", "cauchy", "log_normal", "random", "poisson", "native_dropout",
                    "rrelu", "gumbel_softmax"})
_ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention")


def random_notes(captured) -> tuple[str, ...]:
    """One plan note naming the draws of `captured` (passes.capture.trace.Captured) per op and
    the layers holding them; none for a model that draws nothing (dropout of p = 0)."""
    modules = dict(captured.gm.named_modules())
    owner = captured.layer_of()
    found: dict[str, list[str]] = {}
    for node in captured.gm.graph.nodes:
        what = _draw(node, modules)
        if what:
            layers = found.setdefault(what, [])
            layer = owner.get(node.name, "")
            if layer not in layers:
                layers.append(layer)
    if not found:
        return ()
    said = "; ".join(f"{what} in {_where(layers)}" for what, layers in found.items())
    return (f"the model draws random numbers in its forward ({said}): each rank draws its own "
            f"(runtime/training/rng.py), so parallel training matches one process in "
            f"distribution, not bit for bit; turn the draws off (dropout 0, the model's own "
            f"sampling) to compare a run with one process exactly",)


def _draw(node, modules) -> str | None:
    """The draw `node` makes ("dropout", an op's name), or None."""
    if node.op == "call_module":
        module = modules.get(str(node.target))
        if module is not None and "Dropout" in type(module).__name__:
            return "dropout" if module.training and getattr(module, "p", 0) > 0 else None
        return None
    name = op_graph.op_name(node)
    if name in ("dropout", "feature_dropout", "alpha_dropout"):
        call = op_graph.Call(node, name, modules)
        return "dropout" if op_graph.dropout_active(call) else None
    if name in _ATTENTION:
        p = op_graph.Call(node, name, modules).arg(4, ("dropout_p",), 0.0)
        return "attention dropout" if isinstance(p, (int, float)) and p > 0 else None
    return name if name in _DRAWS else None


def _where(layers: list[str]) -> str:
    named = [layer or "the model" for layer in layers]
    return ", ".join(named[:3]) + (f" and {len(named) - 3} more layers" if len(named) > 3
                                   else "")
