"""Solving a pulp model with HiGHS (through highspy), CBC as the fallback: the status, gap and
proven bound the stage ILP (planner.search.ilp) reads back, and a pulp HiGHS interface that hands
the model over in two calls."""
from __future__ import annotations

import contextlib
import math
import os
import sys

import pulp


NODE_LIMIT = 1000   # branch-and-bound nodes per ILP: a hard one stops at the same node in every run


def run(prob: pulp.LpProblem, solver: str, time_limit_s: float, gap: float,
        node_limit: int = NODE_LIMIT) -> tuple[str, float, float, str]:
    """Solve; read pulp's sol_status (LpStatus says "Optimal" even when a limit stopped it).
    HiGHS (through highspy) is the default; CBC, which ships with pulp, is the fallback. `gap`
    is the relative optimality gap at which the search may stop. The node limit stops a hard
    ILP where it stops in every run (HiGHS's search is deterministic for a given model and
    options); the time limit is a backstop, and a plan it stopped may differ from run to run.
    Returns (status, gap, proven lower bound on the objective — nan when the solver cannot say,
    "node limit" | "time limit" | "" : what stopped the search short of its gap)."""
    if solver == "highs" and pulp.HiGHS().available():
        backend = _HiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap, mip_max_nodes=node_limit)
    else:
        backend = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap,
                                    maxNodes=node_limit)
    with _quiet():
        prob.solve(backend)
    stop = _stop(prob, backend)
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", 0.0, math.nan, ""
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible", _info(prob, backend, "mip_gap"), _dual_bound(prob, backend), stop
    if prob.status == pulp.LpStatusNotSolved:  # stopped before any solution
        return "unsolved", math.nan, _dual_bound(prob, backend), stop
    return "infeasible", 0.0, math.inf, ""


def _stop(prob, backend) -> str:
    try:
        import highspy
    except ImportError:   # CBC: pulp does not say which limit stopped it
        return ""
    model = getattr(backend, "solverModel", None) or getattr(prob, "solverModel", None)
    status = model.getModelStatus() if isinstance(model, highspy.Highs) else None
    return {highspy.HighsModelStatus.kSolutionLimit: "node limit",
            highspy.HighsModelStatus.kTimeLimit: "time limit"}.get(status, "")


class _HiGHS(pulp.HiGHS):
    """pulp's HiGHS interface, handing HiGHS the model in one addCols and one addRows call
    rather than a call per column and per row, and asking pulp for the variables once per solve
    rather than three times (each time it walks every row): the same columns in the same
    (name) order and the same rows, for a third of pulp's share of a small solve."""

    def actualSolve(self, lp):
        self.createAndConfigureSolver(lp)
        self.buildSolverModel(lp)
        self.callSolver(lp)
        status, sol_status = self.findSolutionValues(lp)
        lp.assignStatus(status, sol_status)  # (pulp's resolve bookkeeping is not needed)
        return status

    def findSolutionValues(self, lp):
        """pulp's reading, and a stop at the node limit read as one at the time limit is."""
        import highspy
        model = lp.solverModel
        if model.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
            return super().findSolutionValues(lp)
        values = model.getSolution().col_value
        for var in lp.variables():
            var.varValue = values[var.index]
        feasible = int(highspy.SolutionStatus.kSolutionStatusFeasible)
        if int(model.getInfo().primal_solution_status) == feasible:
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
        return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound

    def buildSolverModel(self, lp):
        import highspy
        import numpy as np
        inf, model = highspy.kHighsInf, lp.solverModel
        columns = lp.variables()
        sign = -1 if lp.sense == pulp.LpMaximize else 1
        for i, var in enumerate(columns):
            var.index = i
        model.addCols(len(columns),
                      np.array([sign * lp.objective.get(v, 0.0) for v in columns], np.float64),
                      np.array([-inf if v.lowBound is None else v.lowBound for v in columns],
                               np.float64),
                      np.array([inf if v.upBound is None else v.upBound for v in columns],
                               np.float64), 0, [], [], [])
        integers = [v.index for v in columns if v.cat == pulp.LpInteger] if self.mip else []
        if integers:
            model.changeColsIntegrality(len(integers), np.array(integers, np.int32),
                                        np.full(len(integers), highspy.HighsVarType.kInteger,
                                                np.uint8))
        lower, upper, starts, indices, values = [], [], [], [], []
        for i, constraint in enumerate(lp._constraints.values()):
            constraint.index = i
            lb, ub = constraint.getLb(), constraint.getUb()
            lower.append(-inf if lb is None else lb)
            upper.append(inf if ub is None else ub)
            starts.append(len(indices))
            for var, coefficient in constraint.items():
                if coefficient != 0:
                    indices.append(var.index)
                    values.append(coefficient)
        model.addRows(len(lower), np.array(lower, np.float64), np.array(upper, np.float64),
                      len(indices), np.array(starts, np.int32), np.array(indices, np.int32),
                      np.array(values, np.float64))


def _info(prob, backend, name: str) -> float:
    model = getattr(backend, "solverModel", None) or getattr(prob, "solverModel", None)
    try:
        return float(getattr(model.getInfo(), name))
    except Exception:  # noqa: BLE001 - a solver without the query reports an unknown value
        return math.nan


def _dual_bound(prob, backend) -> float:
    """HiGHS's proven lower bound, plus the constant term pulp keeps out of the solver."""
    bound = _info(prob, backend, "mip_dual_bound")
    if not math.isfinite(bound):
        return math.nan
    return bound + (prob.objective.constant if prob.objective is not None else 0.0)


@contextlib.contextmanager
def _quiet():
    """HiGHS prints a banner from C++ even with output off: silence fd 1 around the solve."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
