"""The runtime's own time and shared cores, measured for `fxpar calibrate` (CPU ranks): the
runtime terms of a cluster profile (cost_model.hardware.cluster), which need the planner and the runtime
to train a probe, so they are measured here and handed to cost_model.calibration.calibrate.

Op costs price the kernels of a layer. A training step also spends time the ops leave out, and
on a CPU host its ranks may share cores. Calibration measures each part on its own:

  op_overhead,     a one-rank gloo world trains RUNTIME_MODEL at two depths under 1F1B with
  action_floor     two micro-batch counts, a step of each in turn, each step's parts timed by
                   runtime.observe.step_timing. What an F or a B takes beyond its priced compute (the
                   plan's fwd_s, bwd_s, priced with the compute numbers calibrated just before)
                   grows with the ops of the stage's layers: slope (per op, added to every
                   layer's passes) and intercept (per action) of a line over all of them
  action_overhead  the step's "overhead" part (outside the actions) grows with the number of
  step_overhead    actions: slope and intercept over the two micro-batch counts
  split_backward   a transformer block's backward run whole (B) and split the way ZB-H1's
                   executor splits it by default (I, keeping the graph, then W): (I + W) / B - 1
  send_overhead    two ranks, two stages, one micro-batch (every message waited for): the time
  p2p_handoff      a rank spends posting a message, and from the end of the sender's action to
                   the end of the receiver's wait (post, wire, wake-up), medians over the steps
  shared_send_wait,   the same on four ranks, two such pipelines of four micro-batches each,
  shared_p2p_handoff  posting while the other pipeline computes (every core busy): a post then
                   also waits for the core the woken receiver took (beyond send_overhead), and
                   the hand-off of the messages waited for
  recv_overhead    two ranks exchange a message a round between bursts of computation: the
                   CPU of posting the receive and taking the arrived message, plus what gloo's
                   own thread spends on the messages (process minus thread CPU time, beyond
                   the same rounds without messages)
  collective_handoff  two ranks all-reduce after a burst of computation (a layer's), against
                   back to back: the median
  sync_handoff     the same after SYNC_GAP_S of computation (a stage's), the mean
  sync_latency     each calibrated world size runs the step's own small all-reduces as a step
                   reaches them (after a barrier, after SYNC_GAP_S of computation): per ring step
  optimizer_*      planner.training.local.make_optimizer's step timed on many small and a few large
                   tensors: seconds per tensor and per parameter, each step after a sweep of
                   memory larger than the caches, as a training step's forward and backward
                   leave them (a warm step ran several times faster than in training)
  ring_step_*      planner.bench.ring_probe, last: priced with every term above
  cores,           a block's training loop timed alone and in N processes at once, for each
  unshared_ranks   calibrated N in turn: the largest N with no slowdown is unshared_ranks; the
                   first that slows down runs at 1/slowdown of its speed, i.e. on N / slowdown
                   cores. How much ranks slow each other depends on what they run (wider
                   matmuls share caches worse), so the block is timed at two widths and the
                   larger slowdown is kept: the fewer cores
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time

import torch

from cost_model.hardware.cluster import RUNTIME_FIELDS, Cluster

# Small models of their own (not ones a benchmark runs), where the runtime's own time is a large
# share of a step, as it is for the small models CPU ranks can train: two depths of one width,
# so that what an action takes beyond its priced kernels splits into a part per op of its
# layers' graphs and a part per action.
RUNTIME_MODEL = dict(arch="gpt", layers=2, hidden=32, heads=4, vocab=128, seq=16,
                     global_batch=8, name="runtime-probe")
DEEP_LAYERS = 6
MICROBATCHES = (2, 8)
STEPS, WARMUP = 8, 2


def _plan(cluster_json: str, gpus: int, m: int, layers: int = RUNTIME_MODEL["layers"], **fix):
    """RUNTIME_MODEL (with `layers` blocks) and its 1F1B plan with m micro-batches, priced by
    the compute numbers of `cluster_json` and none of the runtime's own terms (which it is here
    to measure)."""
    from planner.api import plan
    from planner.models.presets import ModelConfig
    config = ModelConfig(**{**RUNTIME_MODEL, "layers": layers})
    cluster = dataclasses.replace(Cluster.from_json(json.loads(cluster_json)), **_NEUTRAL)
    fix = {"schedule": "1f1b", "mb": config.global_batch // (m * fix.get("dp", 1)), **fix}
    return config, plan(config, gpus, cluster=cluster, fix=fix)[0]


_NEUTRAL = dict.fromkeys(("op_overhead", *RUNTIME_FIELDS), 0.0)


def _probe(cluster_json: str, m: int, layers: int):
    """(ParallelModel, batch, priced fwd and bwd per micro-batch, ops in the stage's layers) of
    the probe with `layers` blocks on a one-rank world."""
    from cost_model.layers.layer_cost import profile_layer
    from passes.capture.trace import capture
    from planner.api import ParallelModel
    from planner.models.presets import build_model, example_batch
    from planner.training.local import make_optimizer

    config, plan = _plan(cluster_json, 1, m, layers, pp=1, dp=1, tp=1)
    batch = example_batch(config, config.global_batch)
    captured = capture(build_model(config, device="meta"), example_batch(config, 1, device="meta"))
    ops = sum(len(profile_layer(captured, layer).ops) for layer in captured.layers)
    pm = ParallelModel(build_model(config, device="meta"), plan, [], batch, make_optimizer)
    return pm, batch, plan.stages[0].fwd_s, plan.stages[0].bwd_s, ops


def _runtime_worker(cluster_json: str) -> dict:
    """The probes at both depths and micro-batch counts, trained a step each in turn (so that
    the host's drift falls on all of them alike); each one's median parts per step."""
    from runtime.observe.step_timing import StepClock

    torch.set_num_threads(1)
    probes = {(m, layers): _probe(cluster_json, m, layers)
              for m in MICROBATCHES for layers in (RUNTIME_MODEL["layers"], DEEP_LAYERS)}
    parts = {key: [] for key in probes}
    for step in range(WARMUP + STEPS):
        for key, (pm, batch, *_) in probes.items():
            with StepClock(pm.shard()) as clock:
                pm.train_step(*batch)
            if step >= WARMUP:
                parts[key].append(clock.parts())
    # medians, not means: a slow spell of a shared host lands on a step or two
    median = {key: {k: statistics.median(p.get(k, 0.0) for p in ps) for k in ps[0]}
              for key, ps in parts.items()}
    return runtime_terms({key: (median[key], *probes[key][2:]) for key in probes})


def runtime_terms(runs: dict) -> dict:
    """op_overhead, action_floor, action_overhead, step_overhead from {(m, layers): (median
    parts, priced fwd, priced bwd, ops)}: what an F or a B takes beyond its priced compute is
    action_floor + ops x op_overhead (a line over both depths, F and B, both micro-batch
    counts); the step's "overhead" part (outside the actions) is step_overhead + actions x
    action_overhead (two actions per micro-batch; the shallow probe, a line over m)."""
    gaps, counts = [], []
    for (m, _), (parts, fwd, bwd, ops) in runs.items():
        gaps += [parts["F0"] / m - fwd, parts["B0"] / m - bwd]
        counts += [ops, ops]
    per_op, floor = _nonnegative_line(counts, gaps)
    shallow = [(m, parts) for (m, layers), (parts, *_) in runs.items()
               if layers == RUNTIME_MODEL["layers"]]
    slope, intercept = _line([2 * m for m, _ in shallow], [p["overhead"] for _, p in shallow])
    return dict(op_overhead=max(0.0, per_op), action_floor=max(0.0, floor),
                action_overhead=max(0.0, slope), step_overhead=max(0.0, intercept))


def _handoff_worker(cluster_json: str, dp: int = 1, m: int = 1) -> dict | None:
    """dp pipelines of two stages, m micro-batches. Each sender's time posting each message,
    and for each message its receiver waited for, the gap from the end of the sender's action
    to the end of the receiver's wait: medians and means over the steps. One pipeline and one micro-batch: every message
    is waited for, on otherwise idle cores; two pipelines and four micro-batches under 1F1B:
    messages are posted while the other pipeline computes, on a host with every core busy."""
    import torch.distributed as dist

    from planner.api import ParallelModel
    from planner.models.presets import build_model, example_batch
    from planner.training.local import make_optimizer
    from runtime.observe.step_timing import StepClock

    torch.set_num_threads(1)
    config, chosen = _plan(cluster_json, 2 * dp, m, pp=2, dp=dp)
    batch = example_batch(config, config.global_batch)
    pm = ParallelModel(build_model(config, device="meta"), chosen, [], batch, make_optimizer)
    executor = pm.shard().executor
    sends, steps = [], []
    for step in range(WARMUP + STEPS):
        dist.barrier()
        with StepClock(pm.shard()) as clock:
            pm.train_step(*batch)
        if step >= WARMUP:
            sends += clock.intervals("action ", "SEND")
            steps.append(({str(e.action): e.end for e in executor.events},
                          {what: (start, end) for what, start, end in executor.waits}))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (executor.pp_rank, sends, steps))
    rank = dist.get_rank()
    pm.close()  # before the worker returns, where gloo's threads could abort the process
    if rank:
        return None
    first, second = (next(r for r in everyone if r[0] == stage) for stage in (0, 1))
    hops = []
    for (ends0, waits0), (ends1, waits1) in zip(first[2], second[2]):
        for i in range(m):
            hops += _waited(ends0.get(f"0F{i}"), waits1.get(f"1RECV_F{i}"))
            hops += _waited(ends1.get(f"1B{i}"), waits0.get(f"0RECV_B{i}"))
    posts = first[1] + second[1]
    return dict(send=statistics.median(posts), hop=statistics.median(hops) if hops else 0.0,
                send_mean=statistics.fmean(posts), hop_mean=statistics.fmean(hops or [0.0]))


def _waited(sent: float | None, wait: tuple[float, float] | None) -> list[float]:
    """[the gap from a send's action end to the end of its receiver's wait], if the receiver
    was waiting when the action ended (else the message was not what it waited for)."""
    if sent is None or wait is None or wait[0] > sent:
        return []
    return [max(0.0, wait[1] - sent)]


HANDOFF_BYTES = 64 * 2**10  # an all-reduce of a small layer's activations


def _compute(a: torch.Tensor, seconds: float, at_least: int = 0) -> None:
    """Small matmuls on `a` (128 x 128: about 50 us each) for `seconds`, at least `at_least`."""
    start = time.perf_counter()
    for i in itertools.count():
        if i >= at_least and time.perf_counter() - start >= seconds:
            return
        a.copy_(torch.tanh(a @ a * 1e-3))


SYNC_GAP_S = 0.03  # computation before a step's own collectives: a stage's actions, CPU ranks
# Rounds for sync_handoff. One round's extra time scatters over about +-4 ms around a mean of
# 1-2 ms (the ranks end their computing apart, and the host takes a core now and then): 31
# rounds' means, calibrated minutes apart, read 1.0-2.8 ms, and a step pays it three times;
# 121 rounds (about 4 s) read 1.7-2.1 ms in four runs back to back.
SYNC_ROUNDS = 121


def _collective_handoff_worker(rounds: int = 61, gap_s: float = 0.0) -> list[float]:
    """Over rounds, an all-reduce reached from computing minus the one run right after it, back
    to back, on this rank (each round after a barrier: the pair of timings sees the same spell
    of a drifting host). The computation is 20 small matmuls (about a layer's, ~1 ms), or
    `gap_s` seconds of them."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    x, a = torch.randn(HANDOFF_BYTES // 4), torch.randn(128, 128)
    _timed_all_reduce(x)
    extra = []
    for _ in range(rounds):
        dist.barrier()
        _compute(a, gap_s, at_least=20)
        reached = _timed_all_reduce(x)
        extra.append(reached - _timed_all_reduce(x))
    return extra


def _timed_all_reduce(x: torch.Tensor) -> float:
    """Seconds of one all-reduce of x over the world."""
    import torch.distributed as dist
    start = time.perf_counter()
    dist.all_reduce(x)
    return time.perf_counter() - start


def measure_collective_handoff() -> dict:
    """collective_handoff: what an all-reduce its ranks reach from a layer's computing takes
    beyond one run back to back (the median), and sync_handoff the same after SYNC_GAP_S of
    computing (the mean: a step pays it), two gloo ranks. The longer a group's connection has
    idled the longer its wake-up: on a two-core host 0.3 ms after 1 ms of computing, 2 ms after
    10 ms, 2.5 ms after 20 or 40 ms, which is where a step's opening check, its data-parallel
    sync and its loss's all-reduce come from."""
    from runtime.launch.ranks import run_local
    layer = run_local(_collective_handoff_worker, 2)
    step = run_local(_collective_handoff_worker, 2, (SYNC_ROUNDS, SYNC_GAP_S))
    return dict(collective_handoff=max(0.0, statistics.median(map(statistics.median, layer))),
                sync_handoff=max(0.0, statistics.fmean(map(statistics.fmean, step))))


def measure_handoff(cluster: Cluster, world_sizes=(2,)) -> dict:
    """send_overhead and p2p_handoff on one two-rank pipeline (gloo); with four calibrated
    ranks, also shared_send_wait and shared_p2p_handoff on two pipelines whose ranks share the
    cores: what posting takes beyond send_overhead (the sender loses its core to the rank it
    wakes) and the hand-off then."""
    from runtime.launch.ranks import run_local
    cluster_json = json.dumps(cluster.to_json())
    alone = run_local(_handoff_worker, 2, (cluster_json,))[0]
    fields = dict(send_overhead=alone["send"], p2p_handoff=alone["hop"])
    if max(world_sizes) >= 4:
        shared = run_local(_handoff_worker, 4, (cluster_json, 2, 4))[0]
        # means: on shared cores a post or a wake-up now and then waits a whole time slice,
        # rarely but long, and a step pays the mean
        fields.update(shared_send_wait=max(0.0, shared["send_mean"] - alone["send"]),
                      shared_p2p_handoff=shared["hop_mean"])
    return fields


def _step_sync_worker(rounds: int = 61, gap_s: float = SYNC_GAP_S) -> tuple[float, float]:
    """(start, finish): the mean seconds of a step's own small all-reduces on this rank as a
    step reaches them. start: a little work after the ranks last synchronised (the previous
    step's loss, a benchmark's barrier), runtime.training.batch's 16-byte check then
    runtime.training.loss_tokens' 4-byte count; finish: after gap_s of computing, the 4-byte loss."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    check, count, a = torch.zeros(4), torch.zeros(1), torch.randn(128, 128)
    _timed_all_reduce(check)
    start, finish = [], []
    for _ in range(rounds):
        dist.barrier()
        _compute(a, 0.0, at_least=10)
        start.append(_timed_all_reduce(check) + _timed_all_reduce(count))
        _compute(a, gap_s, at_least=20)
        finish.append(_timed_all_reduce(count))
    return statistics.fmean(start), statistics.fmean(finish)


def measure_step_syncs(world_sizes) -> dict:
    """sync_latency: seconds per ring step of the step's own small all-reduces as a step
    reaches them, wake-up included: each calibrated world size's three (see
    _step_sync_worker), fitted through the origin against their ring steps (2 on two ranks, 6
    on four). Extrapolating the links' alpha, fitted from 4 KiB up, to 4 bytes had priced a
    4-rank step's own collectives anywhere from 8 to 16 ms across calibrations of one host."""
    from cost_model.hardware.comm import ring_steps
    from runtime.launch.ranks import run_local
    steps, seconds = [], []
    for n in sorted({n for n in world_sizes if n > 1} or {2}):
        steps.append(3 * ring_steps("all_reduce", n))
        seconds.append(statistics.fmean(sum(r) for r in run_local(_step_sync_worker, n)))
    return dict(sync_latency=max(0.0, slope_through_origin(steps, seconds)))


# About 1 s a loop; four probes of 200 rounds read 0.53-0.60 ms, of 600 rounds 0.45-0.54 ms.
RECV_ROUNDS, RECV_GAP_S = 400, 1e-3


def _recv_worker(rounds: int = RECV_ROUNDS, gap_s: float = RECV_GAP_S) -> float:
    """CPU seconds one received message costs this rank, beyond what its sender's post costs:
    two ranks each post a receive from the other (a new buffer, as the executor posts ahead),
    compute, send, compute, and take the message, which has arrived by then. The main thread's
    CPU posting and taking it (thread CPU time around both), plus the CPU gloo's own thread
    spends on the round's two messages (process minus thread CPU time, beyond a round of the
    same computing without messages)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    peer = 1 - dist.get_rank()
    a, payload = torch.randn(128, 128), torch.randn(HANDOFF_BYTES // 4)

    def others() -> float:  # CPU of the process's other threads so far
        return time.process_time() - time.thread_time()

    def loop(messages: bool) -> tuple[float, float]:
        dist.barrier()
        main, before = 0.0, others()
        for i in range(rounds):
            if messages:
                start = time.thread_time()
                work = dist.irecv(torch.empty_like(payload), src=peer, tag=i)
                main += time.thread_time() - start
            _compute(a, gap_s)
            sent = dist.isend(payload, dst=peer, tag=i) if messages else None
            _compute(a, gap_s)
            if messages:
                start = time.thread_time()
                work.wait()
                main += time.thread_time() - start
                sent.wait()
        return main / rounds, (others() - before) / rounds

    loop(True)  # warm-up: the pair's first messages set up its connection
    _, quiet = loop(False)
    main, busy = loop(True)
    return main + max(0.0, busy - quiet)


def measure_recv_overhead() -> dict:
    """recv_overhead: what a received message costs its rank's CPU (see _recv_worker), the
    mean of the two ranks."""
    from runtime.launch.ranks import run_local
    return dict(recv_overhead=max(0.0, statistics.fmean(run_local(_recv_worker, 2))))


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def slope_through_origin(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of y = slope * x."""
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


def _nonnegative_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line with both >= 0 (noise cannot make a cost
    negative): where the free line has a negative term, the best line with that term 0."""
    slope, intercept = _line(xs, ys)
    if slope < 0:
        return 0.0, max(0.0, statistics.fmean(ys))
    if intercept < 0:
        return max(0.0, slope_through_origin(xs, ys)), 0.0
    return slope, intercept


def measure_runtime(cluster: Cluster) -> dict:
    """action_floor, action_overhead, step_overhead on a one-rank gloo world."""
    from runtime.launch.ranks import run_local
    return run_local(_runtime_worker, 1, (json.dumps(cluster.to_json()),))[0]


SWEEP_BYTES = 256 * 2**20  # more than a CPU's last-level cache


def measure_optimizer(rounds: int = 7) -> dict:
    """optimizer_per_tensor, optimizer_per_param of planner.training.local.make_optimizer's step."""
    from planner.training.local import make_optimizer

    sweep = torch.zeros(SWEEP_BYTES // 4)

    def seconds(tensors: int, size: int) -> float:
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(size)
        opt = make_optimizer(params)
        opt.step()
        times = []
        for _ in range(rounds):
            sweep.add_(1.0)  # the step's tensors leave the caches, as in training
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    many, few = (256, 256), (4, 2**18)
    a, b = per_tensor_and_param(many, seconds(*many), few, seconds(*few))
    return dict(optimizer_per_tensor=a, optimizer_per_param=b)


def per_tensor_and_param(one: tuple[int, int], t_one: float, two: tuple[int, int],
                         t_two: float) -> tuple[float, float]:
    """(a, b) of t = tensors·a + tensors·size·b from two (tensors, size) shapes and their
    times; each clipped at 0 (noise cannot make a cost negative)."""
    (n1, s1), (n2, s2) = one, two
    b = (n1 * t_two - n2 * t_one) / (n1 * n2 * (s2 - s1))
    a = (t_one - n1 * s1 * b) / n1
    return max(0.0, a), max(0.0, b)


def measure_split_backward(rounds: int = 31) -> float:
    """How much longer I + W take than B on a transformer block, as ZB-H1's executor runs them
    by default (runtime.pipeline.executor: autograd.grad to the input keeping the graph, then
    backward to the weights): (I + W) / B - 1."""
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    params = list(block.parameters())
    x = torch.randn(4, 32, 64, requires_grad=True)
    grad = torch.randn(4, 32, 64)

    def full() -> float:
        out = block(x)
        start = time.perf_counter()
        torch.autograd.backward([out], [grad])
        return time.perf_counter() - start

    def split() -> float:
        out = block(x)
        start = time.perf_counter()
        torch.autograd.grad([out], [x], [grad], retain_graph=True)
        torch.autograd.backward([out], [grad], inputs=params)
        return time.perf_counter() - start

    def ratio(i: int) -> float:  # one of each, back to back, in turns of order
        b, iw = (full(), split()) if i % 2 else reversed((split(), full()))
        return iw / b

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full(), split()
        # the median of pairs timed together, not of two runs of rounds one after the other: a
        # slow spell of the host during one of those runs once gave 0 for a 70% traversal
        ratios = [ratio(i) for i in range(rounds)]
    finally:
        torch.set_num_threads(threads)
    return max(0.0, statistics.median(ratios) - 1)


SPIN_WIDTHS = (64, 256)  # the block's hidden size (its MLP four times that)


def _spin(rounds: int = 30, width: int = 64) -> float:
    """Seconds of `rounds` forward + backward passes of a transformer block of hidden size
    `width` (the MLP 4x): the mix of matmuls, pointwise ops and autograd that CPU ranks run.
    The wider block runs fewer rounds, about as many FLOPs."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    x = torch.randn(8, 32, width, requires_grad=True)
    rounds = max(3, rounds * 64**2 // width**2)
    start = time.perf_counter()
    for _ in range(rounds):
        block(x).sum().backward()
    return time.perf_counter() - start


def _spin_worker(trials: int = 9) -> float | None:
    """On every rank: in turns, rank 0 trains the block alone (the others wait at a barrier),
    then every rank at once; rank 0 returns the larger over SPIN_WIDTHS of the median of its
    together / alone ratios (the same warm processes in both, interleaved so that the host's
    drift falls on both)."""
    import torch.distributed as dist
    slowdowns = []
    for width in SPIN_WIDTHS:
        _spin(rounds=5, width=width)  # warm-up: a process's first passes pay for set-up
        ratios = []
        for _ in range(trials):
            dist.barrier()
            alone = _spin(width=width) if dist.get_rank() == 0 else 0.0
            dist.barrier()  # every rank busy at once
            together = _spin(width=width)
            ratios.append(together / alone if alone else 0.0)
        slowdowns.append(statistics.median(ratios))
    return max(slowdowns) if dist.get_rank() == 0 else None


def measure_cores(ranks: int) -> float:
    """Cores `ranks` busy CPU ranks share (0 when they do not slow each other down)."""
    from runtime.launch.ranks import run_local
    return cores_from_slowdown(ranks, run_local(_spin_worker, ranks)[0])


def measure_sharing(world_sizes: list[int]) -> dict:
    """cores (from the largest world size that slows its ranks down) and unshared_ranks (the
    largest that does not), over the calibrated world sizes in increasing order."""
    unshared, cores = 0, 0.0
    for ranks in world_sizes:
        cores = measure_cores(ranks)
        if cores:
            break
        unshared = ranks
    return dict(cores=cores, unshared_ranks=float(unshared))


SHARING_NOISE = 1.05  # slowdowns under this are the probe's noise, not sharing


def cores_from_slowdown(ranks: int, slowdown: float) -> float:
    """`ranks` busy ranks each `slowdown` times slower than one alone share ranks / slowdown
    cores; under 5% slower is noise, not sharing (0: a core per rank). Two ranks on this
    two-core host measured 6-13% slower than one alone (the cores share a cache and memory
    bandwidth), and training steps of two ranks at once ran as much slower than priced at one
    rank's speed: a 15% cut-off had left it out."""
    return 0.0 if slowdown < SHARING_NOISE else ranks / slowdown


RUNTIME_STEPS = ("optimizer step", "split backward", "runtime per action and step",
                 "pipeline hand-off", "ranks sharing cores", "ring attention")


class RuntimeProbe:
    """cost_model.calibration.calibrate's hook for the runtime's own terms: `steps` progress steps, then
    `probe(cluster, world_sizes, step)` returns the fields, measured with the cluster's compute
    numbers; `step(label)` advances calibration's progress bar."""

    steps = len(RUNTIME_STEPS)

    def __call__(self, cluster: Cluster, sizes, step) -> dict:
        fields = {}
        for label in RUNTIME_STEPS:
            if label == "optimizer step":
                fields.update(measure_optimizer())
            elif label == "split backward":
                fields["split_backward"] = measure_split_backward()
            elif label == "runtime per action and step":
                fields.update(measure_runtime(cluster))
            elif label == "pipeline hand-off":
                fields.update(measure_handoff(cluster, sizes or [2]))
                fields.update(measure_collective_handoff())
                fields.update(measure_step_syncs(sizes or [2]))
                fields.update(measure_recv_overhead())
            elif label == "ranks sharing cores":
                fields.update(measure_sharing(sorted(sizes) or [2]))
            else:  # last: priced with every other term
                from planner.bench.ring_probe import measure_ring
                fields.update(measure_ring(dataclasses.replace(cluster, **fields)))
            step(label)
        return fields
