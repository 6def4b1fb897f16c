"""A tiny backend-neutral MILP: the formulation is written once against this and translated to
CP-SAT (integers, enforcement literals) and to PuLP/CBC (floats, big-M from variable bounds).

Every variable and constraint carries a *kind* ("time" in seconds, "mem" in KiB, "count" in GPUs or
booleans) so each backend can scale consistently: CP-SAT turns seconds into integer ticks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    lo: float
    hi: float
    kind: str
    """"bool", "time", "mem" or "count"."""


@dataclass(frozen=True, slots=True)
class Constraint:
    terms: tuple[tuple[int, float], ...]
    sense: str
    """"<=", ">=" or "=="."""
    rhs: float
    kind: str
    enforce: tuple[int, ...] = ()
    """Boolean variables that must all be 1 for the constraint to hold."""


@dataclass(slots=True)
class LinModel:
    vars: list[Var] = field(default_factory=list)
    cons: list[Constraint] = field(default_factory=list)
    objective: list[tuple[int, float]] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    hint: dict[int, float] = field(default_factory=dict)
    group_of: dict[int, int] = field(default_factory=dict)
    """Boolean variable -> id of an at-most-one group it belongs to (tightens big-M bounds)."""

    def new(self, name: str, lo: float, hi: float, kind: str) -> int:
        if name in self.index:
            raise ValueError(f"duplicate variable {name}")
        self.vars.append(Var(name, float(lo), float(hi), kind))
        self.index[name] = len(self.vars) - 1
        return self.index[name]

    def bool(self, name: str) -> int:
        return self.new(name, 0, 1, "bool")

    def add(self, terms, sense: str, rhs: float, kind: str = "count", enforce=()) -> None:
        merged: dict[int, float] = {}
        for v, c in terms:
            merged[v] = merged.get(v, 0.0) + c
        self.cons.append(Constraint(tuple((v, c) for v, c in merged.items() if c != 0), sense, float(rhs), kind,
                                    tuple(enforce)))

    def fix(self, v: int, value: float) -> None:
        self.add([(v, 1.0)], "==", value)

    def and_(self, name: str, x: int, y: int) -> int:
        """z = x AND y."""
        z = self.bool(name)
        self.add([(z, 1), (x, -1)], "<=", 0)
        self.add([(z, 1), (y, -1)], "<=", 0)
        self.add([(z, 1), (x, -1), (y, -1)], ">=", -1)
        return z

    def at_most_one(self, xs) -> None:
        """Declare that at most one of the booleans ``xs`` is 1 (the constraint is added separately)."""
        gid = len(set(self.group_of.values())) + 1
        for x in xs:
            self.group_of.setdefault(x, gid)

    def bounds(self, terms, scale=lambda v: 1.0) -> tuple[float, float]:
        """Range of sum(coef * var) over the variable bounds, using at-most-one groups."""
        lo = hi = 0.0
        groups: dict[int, list[float]] = {}
        for v, c in terms:
            var = self.vars[v]
            c = c * scale(v)
            if v in self.group_of:
                groups.setdefault(self.group_of[v], []).append(c)
                continue
            lo += c * (var.lo if c > 0 else var.hi)
            hi += c * (var.hi if c > 0 else var.lo)
        for cs in groups.values():
            lo += min(0.0, min(cs))
            hi += max(0.0, max(cs))
        return lo, hi
