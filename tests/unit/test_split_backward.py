"""runtime.pipeline.split_backward: I then W give exactly the gradients of one full backward,
whatever the shape of the graph, and W does not run the input path again."""
import pytest
import torch
import torch.nn as nn

from runtime.pipeline.split_backward import input_backward, recomputes, weight_backward


class Shapes(nn.Module):
    """Paths the grouping must get right: a weight used at two heights of the input path (two
    joins of one group, one below the other), a parameter reaching the output on its own (no
    join), a parameter both joining and reaching the output on its own, a parameter the forward
    never reads, a norm, and an attention."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.alone = nn.Parameter(torch.randn(16))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.shared(self.norm(h))  # the same weight again, higher up
        # A second output that no input reaches: the norm's weight joins and also goes alone.
        return h * 2, self.alone.exp() + self.norm.weight


def _outputs(model, x) -> list[torch.Tensor]:
    out = model(x)
    return list(out) if isinstance(out, tuple) else [out]


def _full_grads(model, x, grads):
    x = x.detach().requires_grad_()
    torch.autograd.backward(_outputs(model, x), grads)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return x.grad, grads


@pytest.mark.parametrize("make", [Shapes, lambda: nn.TransformerEncoderLayer(
    16, 2, 32, dropout=0.0, batch_first=True)], ids=["shapes", "transformer-block"])
def test_input_then_weight_gradients_equal_one_backward(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 5, 16)
    grads = [torch.randn_like(t) for t in _outputs(model, x)]
    want_x, want = _full_grads(model, x, grads)
    cache = {}
    for microbatch in range(2):  # the second accumulates, with the parameters' nodes kept
        x_in = x.detach().requires_grad_()
        (got_x,), deferred = input_backward(_outputs(model, x_in), grads, [x_in],
                                            list(model.parameters()), cache)
        if microbatch == 0:
            assert all(p.grad is None for p in model.parameters())  # I: no weight gradient
        weight_backward(deferred)
        torch.testing.assert_close(got_x, want_x)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], 2 * want[name], msg=name)


def test_weights_whose_data_changed_dtype_still_get_their_gradients():
    """The fp32 main weights' step (runtime.training.main_weights) sets each weight's .data to
    fp32 and back, and autograd gives the weight a new AccumulateGrad node: the next step's W
    must still reach every weight, not the node cached from the step before."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = model.to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    grads = [torch.randn_like(t) for t in _outputs(model, x)]
    _, want = _full_grads(model, x, grads)
    cache = {}
    for _ in range(2):
        x_in = x.detach().requires_grad_()
        _, deferred = input_backward(_outputs(model, x_in), grads, [x_in],
                                     list(model.parameters()), cache)
        weight_backward(deferred)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)
        for p in model.parameters():   # the main weights' step, values unchanged
            p.grad, low = None, p.data
            p.data = low.float()
            p.data = low


def test_weight_step_runs_only_the_weights_halves():
    """W from the joins: the input path's nodes (here a tanh between two linears) do not run
    again, where a backward from the outputs to the weights would run them."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    calls = []

    class Tanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            out = h.tanh()
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, g):
            calls.append("tanh")
            (out,) = ctx.saved_tensors
            return g * (1 - out * out)

    x = torch.randn(4, 8, requires_grad=True)
    out = second(Tanh.apply(first(x)))
    params = [*first.parameters(), *second.parameters()]
    _, deferred = input_backward([out], [torch.ones_like(out)], [x], params, {})
    assert calls == ["tanh"]
    weight_backward(deferred)
    assert calls == ["tanh"] and all(p.grad is not None for p in params)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


def _recomputed() -> torch.fx.GraphModule:
    from passes.rewrite.recompute import recompute
    gm = torch.fx.symbolic_trace(TwoLinears())
    region = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return recompute(gm, {"block": region}, full={"block"})


def test_a_recomputing_stage_is_known_and_its_records_would_recompute_per_group():
    """Why the executor retraverses a stage with recomputed layers: each of W's backwards from
    records is a graph task of its own, and the checkpointed region runs its forward again in
    each (two groups: twice), where one backward from the outputs runs it once."""
    gm = _recomputed()
    assert recomputes(gm) and not recomputes(torch.fx.symbolic_trace(TwoLinears()))
    params = list(gm.parameters())
    runs = {}
    for mode in ("record", "retraverse"):
        calls = []
        hook = gm.get_submodule("lin1").register_forward_hook(lambda *_: calls.append(1))
        x = torch.randn(4, 8, requires_grad=True)
        y = gm(x)
        if mode == "record":
            _, deferred = input_backward([y], [torch.ones_like(y)], [x], params, {})
            before_w = len(calls)
            weight_backward(deferred)
        else:
            torch.autograd.grad([y], [x], [torch.ones_like(y)], retain_graph=True)
            before_w = len(calls)
            torch.autograd.backward([y], [torch.ones_like(y)], inputs=params)
        hook.remove()
        runs[mode] = len(calls) - before_w
    assert runs == {"record": 2, "retraverse": 1}


@pytest.mark.parametrize("recomputing", [False, True])
def test_the_executor_records_only_for_stages_that_recompute_nothing(recomputing):
    from runtime.pipeline.executor import StageExecutor
    from runtime.pipeline.generators import make_schedule
    from runtime.programs.stage import StageProgram
    gm = _recomputed() if recomputing else torch.fx.symbolic_trace(TwoLinears())
    programs = {1: StageProgram(1, gm, (), ("x",), ("__loss__",), (), ())}
    executor = StageExecutor(programs, make_schedule("zb-h1", 2, 2), 1, lambda s: s,
                             split_backward="record")
    assert executor.record == (set() if recomputing else {1})


def _left_alive_after_split_backward(pack) -> bool:
    """Whether an output an op saved for its backward outlives a split backward (I, then W
    from its records) run under saved-tensor hooks packing with `pack`."""
    import gc
    import weakref
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved = torch.log_softmax(model(x), -1)        # log_softmax saves its own output
        out = saved * 2
    alive = weakref.ref(saved)
    _, deferred = input_backward([out], [torch.ones_like(out)], [x], list(model.parameters()), {})
    weight_backward(deferred)
    del saved, out, deferred
    gc.collect()
    return alive() is not None


def test_a_pack_hook_keeping_a_detached_alias_frees_the_graph():
    # Kept as is (lambda t: t), the output would outlive the split backward: a cycle through
    # autograd's graph (runtime.programs.saved).
    from runtime.programs.saved import without_graph
    assert not _left_alive_after_split_backward(without_graph)


def test_zero3_with_a_recorded_split_backward_holds_no_more_each_step():
    """A dry run of the last stage (planner.bench.dry_run) peaks the same over 2 and 4 steps:
    nothing a step made is left behind for the next."""
    from planner.api import plan
    from planner.bench.dry_run import dry_run_rank
    from planner.models.presets import get_config
    spec = get_config("llama-tiny")
    p = plan(spec, 4, cluster="cpu-gloo", fix={"dp": 2, "pp": 2, "zero": 3, "mb": 4,
                                                  "schedule": "zb-h1",
                                                  "split_backward": "record"})[0]
    peaks = [dry_run_rank(spec, p, rank=2, steps=s).peak_bytes for s in (2, 4)]
    assert peaks[0] == peaks[1]
