"""Does the context-parallel rewrite of a captured graph run? Tried on a copy, at plan time.

`passes.rewrite.context_parallel.why_not` reads the graph for the constructs the ring cannot take (masks,
shifted labels). What it cannot see is a per-token computation whose literal sizes or positions
are not the ones the rewrite knows to localise (GPT-2's Conv1D flattening batch and sequence into
one dimension, OPT's positions counted by a cumulative sum over the whole sequence): those show
only when the rewritten graph is run on one rank's shapes. `trial_error` runs exactly that — the
rewrite and the shape propagation passes.stages.program applies — on a copy of the graph that shares the
weights, so the planner leaves cp out, and a fixed cp is refused, with the node that failed.
"""
from __future__ import annotations

import copy
import logging
import warnings
from typing import Mapping, Sequence

import torch.fx as fx

from passes.rewrite.context_parallel import ContextParallelError, context_parallel, local_inputs
from passes.rewrite.sharding import ShardingError, localize_shapes, tag_layers


def trial_error(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]], cp: int = 2) -> str | None:
    """None when `gm` rewritten for cp ranks runs on rank 0's shapes; else why it does not."""
    with warnings.catch_warnings():
        # copying an exported graph copies its pytree specs, whose LeafSpec this torch deprecates
        # (a FutureWarning on the user's terminal about torch's own class, nothing to act on)
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)",
                                FutureWarning)
        trial = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    tag_layers(trial, layers)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # logs the failure it raises
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        context_parallel(trial, layers, cp, 0, localize=False)
        localize_shapes(trial, local_inputs(trial, cp))
    except (ContextParallelError, ShardingError, ValueError) as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (f"the context-parallel rewrite does not run on one rank's tokens: {text}; "
                f"plan with cp=1")
    finally:
        quiet.setLevel(level)
    return None
