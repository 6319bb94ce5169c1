"""Expert parallelism as Megatron-LM and torchtitan state it, both ways.

fxpar's layout (planner.search.experts): each MoE layer's experts are cut over `ep` consecutive
ranks of the dp × cp ranks that hold the same weights, so ep divides dp × cp; every tp rank holds
its EP index's experts whole and routes the same tokens (MoE blocks are not sequence-parallel).

* Megatron-LM (megatron/core/parallel_state.py's expert rank generator, arguments.py):
  `--expert-model-parallel-size EP` with `--expert-tensor-parallel-size ETP` (default: tp) cut the
  tp × cp × dp ranks of each pipeline stage into ETP × EP × expert data parallel, so ep × etp must
  divide tp × cp × dp; the expert-parallel group is ep consecutive ranks, the cp ranks first, as
  fxpar's. At tp = 1 that is fxpar's layout and its condition, ep dividing dp × cp. At tp > 1 with
  ep > 1 Megatron-Core runs the experts sequence-parallel (it requires --sequence-parallel), each
  expert split over the tp ranks (etp = tp) or, at etp = 1, the tp ranks taken into the
  expert-parallel group with the tokens split over them: neither is fxpar's layout. At ep = 1 and
  tp > 1, `--expert-tensor-parallel-size 1` keeps the experts whole on each tp rank, as fxpar does.
* torchtitan (torchtitan/distributed/parallel_dims.py, job_config.py): `expert_parallel_degree`
  borrows all of cp and part of `data_parallel_shard_degree` (FSDP's shard ranks, never the
  replicas), with `expert_tensor_parallel_degree` (default 1) either tp (ep a multiple of cp that
  divides shard × cp; the experts split over tp) or 1 (ep a multiple of cp × tp that divides
  shard × cp × tp: the tp ranks in the expert-parallel group). At tp = 1 both read: ep a multiple
  of cp that divides shard × cp; at tp > 1 neither is fxpar's layout.
"""
from __future__ import annotations

from dataclasses import replace

from planner.interop.configuration import Configuration


class Unstated(ValueError):
    """A plan's expert parallelism that the target cannot state (the reason is the message)."""


# ---------------------------------------------------------------------------------------------
# Export: what a configuration with ep > 1 becomes in each target
# ---------------------------------------------------------------------------------------------
def torchtitan_shard(config: Configuration) -> int:
    """data_parallel_shard_degree as --emit torchtitan writes it: FSDP's shard group (all dp
    without hybrid sharding), 1 for replicas."""
    return (config.dp_shard or config.dp) if config.zero == 3 else 1


def unstated(target: str, tp: int, cp: int, ep: int) -> str | None:
    """Why `target` cannot state expert parallelism `ep` on a tp × cp mesh, or None."""
    if ep == 1:
        return None
    if tp > 1:
        how = ("runs experts at tp > 1 sequence-parallel (--sequence-parallel), each expert "
               "split over the tp ranks (--expert-tensor-parallel-size, default tp) or, at 1, the "
               "tp ranks in the expert-parallel group routing their share of the tokens"
               if target == "megatron" else
               "splits each expert over the tp ranks (expert_tensor_parallel_degree = tp) or, "
               "at 1, takes the tp ranks into the expert-parallel group with the tokens split "
               "over them")
        return (f"{_label(target)} {how}; fxpar keeps every expert whole on each of the tp={tp} "
                f"ranks, which route the same tokens (ep={ep})")
    if target == "torchtitan" and ep % cp:
        return (f"torchtitan's expert_parallel_degree takes all of the context-parallel ranks "
                f"(a multiple of context_parallel_degree {cp}); fxpar's ep={ep} is not")
    return None


def nearest_ep(target: str, config: Configuration) -> tuple[Configuration, list[str]]:
    """The configuration with its expert parallelism as `target` states it and what changed;
    Unstated where the target cannot state it."""
    why = unstated(target, config.tp, config.cp, config.ep)
    if why is not None:
        raise Unstated(why)
    if target != "torchtitan" or config.ep == 1:
        return config, []
    if (torchtitan_shard(config) * config.cp) % config.ep == 0:
        return config, []
    # fxpar's ep divides dp x cp: FSDP over all dp ranks always lends torchtitan enough
    sharded = "replicas" if config.zero != 3 else f"shard groups of {config.dp_shard}"
    return replace(config, zero=3, dp_shard=None), [
        f"torchtitan carves expert_parallel_degree {config.ep} out of FSDP's shard ranks "
        f"(data_parallel_shard_degree x context_parallel_degree), which fxpar's {sharded} "
        f"cannot lend; nearest: FSDP (zero=3) over all {config.dp} data-parallel ranks"]


def restricted(target: str) -> list[dict]:
    """The searches (as --fix) among layouts whose expert parallelism `target` states: no
    expert parallelism, or none of tp (nor, for torchtitan, of cp) beside it."""
    fixes = [{"ep": 1}, {"tp": 1}]
    return (fixes + [{"tp": 1, "cp": 1}]) if target == "torchtitan" else fixes


def megatron_flags(config: Configuration, moe: bool) -> list[str]:
    """Megatron-LM's expert-parallel flags for `config` of a model with (`moe`) or without
    experts: the EP size, and at tp > 1 the experts kept whole on each tp rank, as fxpar prices
    them (Megatron-LM's default would split them over tp)."""
    flags = [f"--expert-model-parallel-size {config.ep}"] if config.ep > 1 else []
    if (moe or config.ep > 1) and config.tp > 1:
        flags.append("--expert-tensor-parallel-size 1")
    return flags


def _label(target: str) -> str:
    return "Megatron-LM" if target == "megatron" else "torchtitan"


# ---------------------------------------------------------------------------------------------
# Import: the ep a configuration runs, checked as its framework and fxpar's prices need
# ---------------------------------------------------------------------------------------------
def megatron_ep(f: dict, experts: int | None, tp: int, cp: int, dp: int,
                notes: list[str]) -> int:
    """The ep of Megatron-LM flags `f` for a model of `experts` experts (None: dense); a layout
    Megatron-LM refuses or fxpar cannot price is an error naming the flag and what to give."""
    ep = f.get("--expert-model-parallel-size", 1)
    etp = f.get("--expert-tensor-parallel-size")
    flag = f"--expert-model-parallel-size {ep}"
    if experts is None:
        if ep > 1:
            raise ValueError(f"{flag} needs experts (--num-experts); the model has none: give "
                             f"--expert-model-parallel-size 1")
        if etp is not None:
            notes.append(f"--expert-tensor-parallel-size {etp}: no effect on a model without "
                         f"experts")
        return 1
    _divides_experts(flag, ep, experts, "--expert-model-parallel-size")
    if etp is not None and etp > 1:
        raise ValueError(f"--expert-tensor-parallel-size {etp} splits each expert over {etp} "
                         f"ranks; fxpar prices experts whole on every rank: give "
                         f"--expert-tensor-parallel-size 1")
    if ep > 1 and tp > 1:
        raise ValueError(f"{flag} at --tensor-model-parallel-size {tp}: "
                         + unstated("megatron", tp, cp, ep)
                         + ": give --tensor-model-parallel-size 1 or "
                           "--expert-model-parallel-size 1")
    if (dp * cp) % ep:
        raise ValueError(f"{flag} does not divide data parallel {dp} x context parallel {cp} = "
                         f"{dp * cp} (Megatron-LM carves the expert-parallel ranks out of them): "
                         f"give a divisor of {dp * cp}")
    if etp is None and tp > 1:
        notes.append(f"without --expert-tensor-parallel-size Megatron-LM splits each expert over "
                     f"the tp={tp} ranks (its default: tp); priced as fxpar runs them, whole on "
                     f"each tp rank (--expert-tensor-parallel-size 1)")
    return ep


def torchtitan_ep(get, experts: int | None, tp: int, cp: int, shard: int,
                  notes: list[str]) -> int:
    """The ep of a torchtitan [parallelism] table (`get(name, kind, default)` reads a field)
    for a model of `experts` experts (None: dense); what torchtitan refuses or fxpar cannot
    price is an error naming the field and what to give."""
    ep = get("expert_parallel_degree", int, 1)
    etp = get("expert_tensor_parallel_degree", int, 1)
    for name, value in (("expert_parallel_degree", ep), ("expert_tensor_parallel_degree", etp)):
        if value < 1:
            raise ValueError(f"[parallelism] {name} must be at least 1, got {value}")
    field = f"[parallelism] expert_parallel_degree = {ep}"
    if ep == 1:
        if etp > 1:
            notes.append(f"[parallelism] expert_tensor_parallel_degree = {etp}: no effect at "
                         f"expert_parallel_degree = 1 (torchtitan's rule)")
        return 1
    if etp not in (1, tp):
        raise ValueError(f"[parallelism] expert_tensor_parallel_degree = {etp}: torchtitan takes "
                         f"1 or tensor_parallel_degree ({tp})")
    if tp > 1:
        raise ValueError(f"{field} at tensor_parallel_degree = {tp}: "
                         + unstated("torchtitan", tp, cp, ep)
                         + ": give tensor_parallel_degree = 1 or expert_parallel_degree = 1")
    if ep % cp or (shard * cp) % ep:
        raise ValueError(f"{field}: torchtitan borrows it from context_parallel_degree {cp} "
                         f"(all of it) and data_parallel_shard_degree {shard}: give a multiple of "
                         f"{cp} that divides {shard * cp}")
    if experts is None:
        notes.append(f"{field}: no effect on a model without experts (torchtitan's rule)")
        return 1
    _divides_experts(field, ep, experts, "expert_parallel_degree")
    return ep


def _divides_experts(said: str, ep: int, experts: int, name: str) -> None:
    if experts % ep:
        legal = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise ValueError(f"{said} does not divide the model's {experts} experts: give "
                         f"{name} one of {legal}")
