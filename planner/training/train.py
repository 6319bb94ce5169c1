"""The training loop of `fxpar train`, on every rank of a launch (torchrun, fxpar's own launcher
which runs torchrun's engine, or a test's pool of ranks).

Each start — the first, or a restart after a rank died — does the same: plan for the world size
it finds (rank 0 plans, every rank takes its plan), build this rank's shard on the meta device,
load the latest complete checkpoint if there is one (saved under any plan: it reshards), and
train from its step. So a restart with as many ranks continues bit for bit, and one with fewer
or more ranks (a node lost under `--nnodes 1:2`) plans again and continues resharded; the log
and metrics.jsonl say which plan the checkpoint was saved under and which one continues.

Per step, on every rank: this rank's rows of the step's batch (planner.training.data: a pure
function of seed and step, each data-parallel rank reading only its own rows), the learning
rate of the step (planner.training.schedule), one pipeline iteration (PipelineTrainer: clipping
by the global gradient norm, autocast precision), then rank 0's report (planner.training.
metrics). Every `eval.every` steps the validation loss goes forward only through the same plan
(runtime.training.evaluate); every `checkpoint.every` steps and at the end a DCP checkpoint.
"""
from __future__ import annotations

import dataclasses

import gc
import math
import os
import shutil
import time

import torch
import torch.distributed as dist

from planner.search.plan import Plan
from planner.training import optimizer as optim
from planner.training.data import TokenData, open_data
from planner.training.metrics import Clock, Metrics, peak_memory_bytes, plan_summary, plot_losses
from planner.training.model_spec import ModelSpec, example_batch, model_spec, parameter_count
from planner.training.schedule import LRSchedule
from planner.training.shard_decay import decay_shards, shard_mask
from runtime.checkpoint import state as checkpoint
from runtime.launch.ranks import init_from_env
from runtime.training.evaluate import Evaluator, evaluate
from runtime.training.trainer import TrainOptions

CHECKED_ENV = "FXPAR_TRAIN_CHECKED"   # set by fxpar's launcher once it verified the data


class TrainError(RuntimeError):
    """The run cannot go on (a loss that is not finite, a plan rank 0 could not make)."""


def agreed(fn, what: str):
    """fn() on rank 0, its result on every rank; an error there is raised on every rank, so no
    rank waits for a peer that gave up."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except (ValueError, RuntimeError, OSError, KeyError) as err:
            box = [("error", f"{what}: {' '.join(str(err).split())}")]
        except Exception as err:  # noqa: BLE001 - a bug: its traceback here, its name there
            import traceback
            traceback.print_exc()
            box = [("error", f"{what}: {type(err).__name__}: {' '.join(str(err).split())}")]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise TrainError(value)
    return value


def cluster_name(config, cuda: bool) -> str:
    if config.parallel.cluster != "auto":
        return config.parallel.cluster
    from planner.api import default_cluster
    return default_cluster() if cuda else "cpu-gloo"


def make_plan(spec: ModelSpec, model, world: int, config, cluster: str) -> Plan:
    """The best plan for `world` devices (the config's fix applied)."""
    from planner.api import plan
    inputs = None
    if spec.is_hf:
        tokens = torch.zeros(config.training.global_batch, spec.seq, dtype=torch.long,
                             device="meta")
        inputs = (tokens, tokens)
    precision = config.precision(torch.cuda.is_available())
    return plan(spec.plan_target(model), world, inputs, cluster=cluster,
                global_batch=config.training.global_batch,
                memory_limit=config.parallel.memory_limit or None, fix=config.fix,
                autocast=precision if precision in ("bf16", "fp16") else None)[0]


class Rows:
    """The batches this rank reads: global-shaped (tokens, targets) whose rows of this rank's
    data-parallel index are filled from the token files and the rest left zero — the trainer
    takes each replica's rows of the global batch (runtime.training.trainer.split_batch)."""

    def __init__(self, data: TokenData, trainer, seed: int, global_batch: int, seq: int,
                 device):
        self.data, self.seed, self.batch, self.seq = data, seed, global_batch, seq
        self.device = device
        dp, index = trainer.groups.mesh.dp, trainer.groups.dp_index
        self.lo, self.hi = index * global_batch // dp, (index + 1) * global_batch // dp

    def _place(self, split: str, offsets) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.rows(split, offsets[self.lo: self.hi], self.seq)
        tokens = torch.zeros(self.batch, self.seq, dtype=torch.long)
        targets = torch.zeros(self.batch, self.seq, dtype=torch.long)
        tokens[self.lo: self.hi] = torch.from_numpy(x)
        targets[self.lo: self.hi] = torch.from_numpy(y)
        return tokens.to(self.device), targets.to(self.device)

    def train(self, step: int):
        return self._place("train", self.data.train_offsets(self.seed, step, self.batch,
                                                            self.seq))

    def val(self, index: int):
        return self._place("val", self.data.val_offsets(index, self.batch, self.seq))


def name_groups(trainer, model: torch.nn.Module, config) -> None:
    """Give the trainer's optimizer its decayed and not-decayed groups by parameter name (the
    trainer built it from parameters alone). Sharded data parallel's flat shards, which mix
    parameters, go in the not-decayed group and are decayed by mask (planner.training.shard_decay)."""
    from runtime.training.tied import canonical_names
    canonical = canonical_names(tuple(c.names for c in trainer.tied))
    embeddings = optim.embedding_names(model)
    decayed = lambda name, p: optim.decayed(canonical.get(name, name), p, embeddings,  # noqa: E731
                                            config.optimizer)
    sharded = trainer.sharded
    shards = {id(b.shard): b for b in sharded.buckets} if sharded is not None else {}
    stepped = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    wanted = stepped - set(shards)
    named, seen = [], set()
    for program in trainer.programs.values():
        for name, param in program.gm.named_parameters():
            if id(param) in wanted and id(param) not in seen:
                seen.add(id(param))
                named.append((canonical.get(name, name), param))
    groups = optim.param_groups(named, embeddings, config.optimizer)
    groups[1]["params"] += [b.shard for b in shards.values()]
    trainer.optimizer = optim.build(groups, config.optimizer)
    masks = {key: shard_mask(b, decayed) for key, b in shards.items()}
    decay_shards(trainer.optimizer, masks, config.optimizer.weight_decay)


def join_process_group(timeout_s: float) -> None:
    """Join the launch's process group. Under torchrun's elastic agent the workers of every
    attempt meet in the agent's one TCPStore, where the previous attempt's keys (each rank's
    address) are still there: a restarted rank could read a dead peer's address before the
    peer's new one is written. So each attempt's group lives under a prefix of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        init_from_env(timeout_s=timeout_s)
        return
    from datetime import timedelta
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    env = os.environ
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                          world_size=int(env["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = (f"fxpar/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT')}"
               f"/{env['WORLD_SIZE']}/")
    dist.init_process_group(backend, store=dist.PrefixStore(attempt, store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=timeout)


def _threads() -> None:
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    elif not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _peak_memory() -> float:
    """The largest peak memory of any rank (collective)."""
    value = torch.tensor([peak_memory_bytes()], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _prune(root: str, keep: int) -> None:
    if not keep:
        return
    steps = sorted(entry for entry in os.listdir(root)
                   if entry.startswith("step-") and checkpoint.is_complete(os.path.join(root,
                                                                                       entry)))
    for entry in steps[:-keep]:
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def resume_path(config) -> str | None:
    resume = config.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return checkpoint.latest(config.checkpoint_dir)
    return checkpoint.resolve(resume)


def _describe_resume(info: dict, path: str, plan: Plan, world: int) -> tuple[str, dict]:
    """The log line of a resume and the fields metrics.jsonl keeps of it."""
    extra = info.get("extra") or {}
    old = Plan.from_json(extra["plan"]) if extra.get("plan") else None
    old_world = extra.get("world_size")
    now = plan_summary(plan)
    before = plan_summary(old) if old else "an unknown plan"
    same = old is not None and before == now and old_world == world
    if same:
        line = (f"resumed from step {info['step']} ({path}) under the same plan on {world} "
                f"ranks: {now}")
    else:
        line = (f"re-planned: the checkpoint of step {info['step']} ({path}) was saved under "
                f"{before} on {old_world} ranks; continuing under {now} on {world} ranks")
    return line, {"resumed_from": info["step"], "checkpoint": path, "replanned": not same,
                  "old_plan": before, "old_world_size": old_world}


def run(config, log=print) -> dict:
    """Train on this rank as `config` (planner.training.config.TrainConfig) says; returns what
    the run did (rank 0's report is printed through `log`). Joins the torchrun process group
    unless one is already set up (a test's pool)."""
    owns = not dist.is_initialized()
    if owns:
        join_process_group(config.timeout_s(torch.cuda.is_available()))
    _threads()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = log if rank == 0 else (lambda *a, **k: None)
    cuda = torch.cuda.is_available()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(config.training.seed)
    t = config.training
    spec = model_spec(config)
    verify = config.data.verify and os.environ.get(CHECKED_ENV) != "1"
    agreed(lambda: open_data(config.data.path, verify=verify).check_fits(
        spec.vocab, spec.seq, t.global_batch), "data")
    data = open_data(config.data.path)
    options = TrainOptions(max_norm=config.clip or math.inf, precision=config.precision(cuda))
    model = spec.meta_model()
    if options.precision == "bf16-main":   # planned in the dtype it trains in (meta: no cost)
        model = model.to(torch.bfloat16)
    cluster = cluster_name(config, cuda)
    started = time.perf_counter()
    plan = Plan.from_json(agreed(lambda: make_plan(spec, model, world, config, cluster).dumps(),
                                 f"planning {spec.name} for {world} devices"))
    planned_s = time.perf_counter() - started
    from planner.api import ParallelModel
    pm = ParallelModel(model, plan, [], example_batch(spec, t.global_batch),
                       lambda params: optim.build(params, config.optimizer),
                       weights=spec.weights, seed=t.seed, options=options)
    trainer = pm.shard()
    name_groups(trainer, model, config)
    from planner.weights.materialize import shard_device
    rows = Rows(data, trainer, t.seed, t.global_batch, spec.seq, shard_device())
    trainer.batch_spec.check(rows.train(1))  # the shapes once; the ranks read different rows
    trainer.batch_spec = None  # (each its replica's), so the every-rank-same-batch check is off
    resume = agreed(lambda: resume_path(config), "checkpoint")
    start_fields, resumed = {}, None
    if resume is not None:
        info = pm.load(resume)
        if info["step"] > t.steps:
            raise TrainError(f"the checkpoint {resume} is at step {info['step']}, past "
                             f"[training] steps {t.steps}: ask for more steps, or start "
                             f"afresh with --checkpoint.resume never (or another "
                             f"checkpoint.dir)")
        line, start_fields = _describe_resume(info, resume, plan, world)
        resumed = info["step"]
        say(line)
        if start_fields["replanned"]:
            say(str(plan))
    else:
        say(str(plan))
    say(f"planned in {planned_s:.2f} s; {'resuming at' if resumed else 'training from'} step "
        f"{pm.step} of {t.steps} on {world} ranks (attempt {attempt})")
    from cost_model.hardware.cluster import get_cluster
    metrics = Metrics(config.logging.dir, t.steps, config.logging.every, plan,
                      get_cluster(plan.cluster).peak_flops, enabled=rank == 0, attempt=attempt,
                      progress=config.logging.progress, tensorboard=config.logging.tensorboard,
                      first_step=pm.step, log=log)
    metrics.record("start", step=pm.step, world_size=world, plan=plan_summary(plan),
                   plan_json=plan.to_json(timing=False), model=spec.name, **start_fields)
    evaluator = Evaluator(trainer) if config.eval.every or config.eval.at_end else None
    schedule = LRSchedule.of(config)
    if resumed:
        changed = schedule_change(info, schedule, resumed)
        if changed:
            say(changed)
    root = config.checkpoint_dir
    saved_at = resumed
    clock = Clock()
    first = pm.step
    val_loss = None
    losses: dict[int, float] = {}
    try:
        while pm.step < t.steps:
            step = pm.step + 1
            clock.mark("other")
            batch = rows.train(step)
            clock.mark("data")
            lr = schedule(step)
            optim.set_lr(trainer.optimizer, lr)
            clock.mark("schedule")
            loss = pm.train_step(*batch)
            step_s = clock.mark("step")
            if not math.isfinite(loss):
                raise TrainError(f"the loss is {loss} at step {step}: lower [optimizer] lr, "
                                 f"clip gradients ([training] clip_grad_norm) or use fp32")
            losses[step] = loss
            logs = step % config.logging.every == 0 or step == t.steps
            peak = _peak_memory() if logs else None
            metrics.step(step, loss, lr, trainer.grad_norm, step_s, peak)
            clock.mark("logging")
            if config.checkpoint.every and step % config.checkpoint.every == 0:
                _save(pm, root, step, plan, world, spec, config, say)
                saved_at = step
                clock.mark("checkpoint")
            if config.eval.every and step % config.eval.every == 0:
                val_loss = _evaluate(evaluator, rows, config, metrics, step)
                clock.mark("eval")
        if saved_at != pm.step:
            _save(pm, root, pm.step, plan, world, spec, config, say)
            clock.mark("checkpoint")
        if config.eval.at_end and (not config.eval.every or pm.step % config.eval.every):
            val_loss = _evaluate(evaluator, rows, config, metrics, pm.step)
            clock.mark("eval")
        title = f"{spec.name} ({parameter_count(model)})"
        summary = _finish(clock, pm.step - first, metrics, config, data, spec, plan, val_loss,
                          root, say, title)
    finally:
        metrics.close()
    summary.update(first_step=first, losses=losses, plan=plan.dumps(timing=False),
                   world_size=world, val_loss=val_loss)
    if owns:
        pm.close()
    else:
        del trainer, pm
        gc.collect()
    return summary


def schedule_change(info: dict, schedule: LRSchedule, step: int) -> str | None:
    """What a resumed run's learning rate does from the checkpoint's step on, where its schedule
    is not the one the checkpoint trained under (more steps stretch a decay run to the last)."""
    saved = (info.get("extra") or {}).get("lr_schedule")
    if not saved or LRSchedule(**saved) == schedule:
        return None
    old = LRSchedule(**saved)
    hint = (f"; set lr_schedule.decay_steps = {old.decay_steps} to go on with the old one"
            if old.decay_steps != schedule.decay_steps else "")
    return (f"the learning-rate schedule is not the one the checkpoint trained under (decay "
            f"over {old.decay_steps} steps, now {schedule.decay_steps}): step {step} trained "
            f"at lr {old(step):.4g}, step {step + 1} now trains at {schedule(step + 1):.4g} "
            f"(the old schedule: {old(step + 1):.4g}){hint}")


def _save(pm, root, step, plan, world, spec, config, say) -> None:
    started = time.perf_counter()
    path = pm.save(checkpoint.step_dir(root, step),
                   extra={"plan": plan.dumps(timing=False), "world_size": world,
                          "model": spec.name,
                          "lr_schedule": dataclasses.asdict(LRSchedule.of(config))})
    if dist.get_rank() == 0:
        _prune(root, config.checkpoint.keep)
    say(f"saved checkpoint {path} ({time.perf_counter() - started:.1f} s)")


def _evaluate(evaluator, rows: Rows, config, metrics: Metrics, step: int) -> float:
    started = time.perf_counter()
    loss = evaluate(evaluator, [rows.val(k) for k in range(config.eval.steps)])
    metrics.eval(step, loss, time.perf_counter() - started, config.eval.steps)
    return loss


def _finish(clock: Clock, steps: int, metrics: Metrics, config, data: TokenData, spec, plan,
            val_loss, root, say, title: str) -> dict:
    """Export, plot, and the closing lines: validation loss beside the unigram entropy, and the
    trainer's own time around the steps."""
    totals = clock.totals
    loop = sum(totals.get(k, 0.0) for k in ("data", "schedule", "logging", "other"))
    stepping = totals.get("step", 0.0)
    overhead = loop / stepping if stepping else 0.0
    entropy = data.splits["val"].unigram_entropy
    rank0 = dist.get_rank() == 0
    if rank0 and steps:
        per = {k: 1e3 * totals.get(k, 0.0) / steps for k in ("data", "schedule", "logging",
                                                              "other")}
        say(f"trainer overhead around the step: {100 * overhead:.2f}% of step time (per step: "
            f"data {per['data']:.2f} ms, schedule {per['schedule']:.2f} ms, logging "
            f"{per['logging']:.2f} ms, loop {per['other']:.2f} ms; step "
            f"{1e3 * stepping / steps:.1f} ms)")
    if val_loss is not None:
        say(f"validation loss {val_loss:.4f} nats per token; unigram entropy of the validation "
            f"split {entropy:.4f} nats ({'below' if val_loss < entropy else 'NOT below'} it by "
            f"{abs(entropy - val_loss):.4f})")
    export = config.checkpoint.export
    exported = None
    if rank0 and (export is True or (export == "auto" and spec.is_hf)):
        from planner.weights.export import export as export_hf, export_line
        out = os.path.join(config.logging.dir, "hf", "model.safetensors")
        path, count, hf = export_hf(root, out)
        exported = out
        say(export_line(out, path, count, hf, False))
    picture = None
    if rank0 and config.logging.plot:
        metrics.flush()
        picture = plot_losses(metrics.path, os.path.join(config.logging.dir, "loss.png"),
                              f"{title}: {plan_summary(plan)}", entropy)
        say(f"loss curve: {picture}")
    metrics.record("end", step=steps, overhead=overhead, val_loss=val_loss,
                   unigram_entropy=entropy,
                   seconds={k: round(v, 4) for k, v in totals.items()})
    return {"overhead": overhead, "seconds": dict(totals), "unigram_entropy": entropy,
            "exported": exported, "picture": picture}
