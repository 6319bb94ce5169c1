"""The bytes a rank sends per block against the bytes the cost model prices for them."""
import torch

from cost_model.hardware.cluster import get_cluster
from cost_model.layers.layer_cost import price, profile_layer
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from passes.stages.program import Layout, rank_programs
from planner.training.local import build
from runtime.comm import instrument
from runtime.comm.mesh import Mesh, mesh_groups


def block_traffic(spec, tp: int, mb: int) -> tuple[dict, dict]:
    """Runs on each rank of 4: one forward and backward of a micro-batch of `spec`'s model,
    every block tensor-parallel, pp=1; per block the bytes this rank sent by kind, and what the
    cost model prices for it."""
    torch.manual_seed(0)
    model, batch = build(spec)
    micro = tuple(x[:mb] for x in batch)
    captured = capture(model, micro)
    priced = {b.name: dict(price(profile_layer(captured, b, tp), Strategy.parse("tp"), mb,
                                 get_cluster("cpu-gloo"), tp).comm_bytes)
              for b in captured.blocks}
    groups = mesh_groups(Mesh(1, 4 // tp, tp))
    layout = Layout(tp, tuple((b.name, "tp") for b in captured.blocks), (len(captured.layers),))
    program = rank_programs(captured, layout, groups.tp_index, (0,))[0]
    with instrument.counting() as traffic:
        out = program.gm(*micro)
        (out[0] if isinstance(out, tuple) else out).backward()
    return {b.name: traffic.layer(b.name) for b in captured.blocks}, priced
