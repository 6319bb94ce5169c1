"""Linear expressions for the stage ILP (planner.search.ilp), kept as plain dicts until pulp
gets them, and the few pulp calls that take them."""
from __future__ import annotations

import pulp


class Lin:
    """A linear expression, {variable: coefficient} in insertion order plus a constant, that the
    model is built from before pulp gets it.

    pulp's operators cost most of a solve in Python (an LpAffineExpression per product, type
    checks per term of a sum: 12 ms to build a 32-stage problem, three times what HiGHS takes
    to solve its LP). These plain dicts do the same arithmetic — the same floating-point
    operations in the same order as pulp's +, −, scalar × and lpSum, down to a product with 0
    dropping its terms — so each row pulp hands HiGHS is bit for bit the one its operators would
    have built (checked on every stage problem, LP and ILP, that the presets of
    examples/bench_planner.py pose)."""

    __slots__ = ("terms", "constant")

    def __init__(self, terms: dict | None = None, constant: float = 0.0):
        self.terms = {} if terms is None else terms
        self.constant = constant

    def add(self, other, sign: int = 1) -> Lin:
        """self += sign · other, for another Lin or a number (pulp's addInPlace)."""
        if isinstance(other, Lin):
            self.constant += other.constant * sign
            terms = self.terms
            for v, x in other.terms.items():
                terms[v] = terms[v] + x * sign if v in terms else x * sign
        else:
            self.constant += other * sign
        return self

    def copy(self) -> Lin:
        return Lin(dict(self.terms), self.constant)

    def __add__(self, other) -> Lin:
        return self.copy().add(other)

    __radd__ = __add__

    def __sub__(self, other) -> Lin:
        return self.copy().add(other, -1)

    def __rmul__(self, c: float) -> Lin:
        """c · self; as in pulp, 0 · self has neither terms nor constant."""
        if c == 0:
            return Lin()
        return Lin({v: c * x for v, x in self.terms.items()}, self.constant * c)

    def affine(self) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression(self.terms, self.constant)


def lin_sum(items) -> Lin:
    """pulp.lpSum of Lin expressions and numbers."""
    total = Lin()
    for item in items:
        total.add(item)
    return total


def scaled(variables, coefficients) -> dict:
    """{v: c} over pairs, as pulp's Σ v·c makes it: a product with 0 adds no term."""
    return {v: c for v, c in zip(variables, coefficients) if c != 0}


def add_row(prob, lhs: Lin, sense: int, rhs, name: str) -> None:
    """prob += lhs (sense) rhs, rhs a number or a Lin, as pulp's comparison operators make it."""
    if isinstance(rhs, Lin):
        lhs, rhs = lhs - rhs, None
    prob.addConstraint(pulp.LpConstraint(lhs.affine(), sense, name, rhs))


def var(prob: pulp.LpProblem, name: str, upper=None, cat: str = "Continuous"):
    """A non-negative variable (pulp >= 3.3 attaches variables to the problem)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, 0, upper, cat=cat)
    return pulp.LpVariable(name, 0, upper, cat=cat)


def count(variables) -> Lin:
    """Σ v over the variables: a count of blocks."""
    return Lin(dict.fromkeys(variables, 1))
