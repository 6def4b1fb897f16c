"""One plan cache's answers shared between the forked workers of ``simulate(..., workers=N)``.

``PlanCache.best`` is a pure function of its key (the simulator's solves use CP-SAT's deterministic
time limit), and so is ``PlanCache.transition_cost``. Policies in different worker processes ask many
of the same questions (``adaptive``, ``adaptive-restart`` and ``always`` choose from the same layouts;
the offline policies' extra candidates are solved on the controllers' workload grid), so each answer
is computed once, by whichever worker asks first, and read by the others: the same answers as each
worker solving alone, in less CPU.

A worker that asks a question another worker is solving waits for its answer (a worker holds at
most one unanswered question, the one it solves, and waits only while holding none: no cycle). A
question left unanswered (its worker failed) is solved locally after ``WAIT_S``.
"""
from __future__ import annotations

import os
import time
from typing import Any

WAIT_S = 900.0
"""Longest wait for another worker's answer before solving the question here."""
POLL_S = 0.005


class SharedAnswers(dict):
    """A ``dict`` of one process's answers (what ``PlanCache`` keeps in ``_plans`` / ``_costs``)
    backed by ``store``, a dict shared between processes (``multiprocessing.Manager().dict()``).

    ``key in answers`` is True when this process or any other holds the answer (copied here); when
    no one does, this process claims the key and answers False, so that the cache computes it and
    stores it (``answers[key] = value``), which publishes it. ``on_value(value, extra)`` /
    ``extra()``: what else a computed answer carries (the cache's ``last_message``)."""

    def __init__(self, store: Any, tag: str, initial: dict | None = None, extra=None, on_value=None) -> None:
        super().__init__(initial or {})
        self.store, self.tag = store, tag
        self._extra, self._on_value = extra, on_value
        self._mine = f"pending {os.getpid()}"
        self.hits = 0

    def _k(self, key) -> tuple:
        return (self.tag, key)

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        k = self._k(key)
        got = self.store.setdefault(k, self._mine)
        if got == self._mine:
            return False  # ours to compute
        t0 = time.perf_counter()
        while isinstance(got, str):  # another worker is computing it
            if time.perf_counter() - t0 > WAIT_S:
                return False
            time.sleep(POLL_S)
            got = self.store.get(k, self._mine)
            if got == self._mine:  # vanished: compute it here
                return False
        value, extra = got
        if self._on_value is not None:
            self._on_value(value, extra)
        dict.__setitem__(self, key, value)
        self.hits += 1
        return True

    def get(self, key, default=None):
        return dict.__getitem__(self, key) if key in self else default

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        self.store[self._k(key)] = (value, self._extra() if self._extra else None)


def share(plans: Any, prices: Any, store: Any) -> None:
    """Make ``plans`` (a ``PlanCache``) read and publish its solves and transition bounds, and
    ``prices`` (the truth's ``LayoutChangePrices``) its layout-change prices, through ``store`` (in a
    forked worker, before it asks anything)."""
    if isinstance(plans._plans, SharedAnswers):
        return  # this process shares already
    def message() -> str:
        return plans.last_message

    def set_message(value, msg) -> None:
        if value is None and msg is not None:
            plans.last_message = msg  # what solving here would have left

    plans._plans = SharedAnswers(store, "plan", plans._plans, message, set_message)
    plans._costs = SharedAnswers(store, "transition bound", plans._costs)
    prices._seen = SharedAnswers(store, "layout change", prices._seen)
