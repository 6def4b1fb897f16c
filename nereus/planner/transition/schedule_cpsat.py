"""Choosing a transition's schedule: ``schedule_transition`` takes the greedy (with host staging
when memory binds) and improves it with the CP-SAT model here when asked, or on small problems
where the greedy is more than 1% above the lower bound. The model: one interval per
transfer bucket, no-overlap per send / receive / copy resource, host staging where the greedy
staged, a reservoir per tight GPU for memory; minimise makespan, seeded with the greedy."""
from __future__ import annotations

from nereus.errors import TransitionError
from nereus.planner.transition.schedule import Schedule, ScheduleProblem, greedy, staging_plan, task_resources


def schedule_transition(p: ScheduleProblem, *, scheduler: str = "auto", time_limit_s: float = 2.0,
                        cpsat_max_tasks: int = 400) -> Schedule:
    """Greedy first (hint and fallback); CP-SAT when asked, or on 'auto' when the problem is small
    and the greedy is more than 1% above the lower bound."""
    staged: dict[int, float] = {}
    sched = greedy(p)
    if sched is None:
        staged = staging_plan(p)
        sched = greedy(p, staged)
        if sched is None:
            raise TransitionError(f"no memory-safe schedule found for {p.n} transfer buckets even with host staging")
    use_cpsat = scheduler == "cpsat" or (scheduler == "auto" and p.n <= cpsat_max_tasks
                                         and sched.makespan_s > 1.01 * p.lower_bound_s)
    if use_cpsat and p.n:
        better = solve_cpsat(p, sched, time_limit_s=time_limit_s)
        if better is not None and (better.makespan_s < sched.makespan_s or scheduler == "cpsat"):
            sched = better
    return sched


def solve_cpsat(p: ScheduleProblem, hint: Schedule, *, time_limit_s: float = 2.0) -> Schedule | None:
    """Time-indexed CP-SAT model seeded with ``hint``; None when it finds nothing.

    Determinism: one worker and a *deterministic* time limit, so every rank gets the same answer
    whatever its CPU speed (``time_limit_s`` is read as deterministic seconds); a wall-clock guard
    of 4x that stops it on a badly overloaded machine (only then may answers differ).
    """
    from ortools.sat.python import cp_model

    unit = max(hint.makespan_s, 1e-9) / 20000.0  # seconds per model tick
    m = cp_model.CpModel()
    horizon = int(hint.makespan_s / unit) + 2 + int(max(hint.staged.values(), default=0.0) / unit)
    dur = [max(1, int(-(-d // unit))) for d in p.dur]
    horizon = max(horizon, sum(dur) + 1) if hint.staged else max(horizon, max(dur, default=1) + 1)
    start = [m.new_int_var(0, horizon, f"start[{t}]") for t in range(p.n)]
    end = [m.new_int_var(0, horizon, f"end[{t}]") for t in range(p.n)]
    iv = [m.new_interval_var(start[t], dur[t], end[t], f"xfer[{p.src[t]}->{p.dst[t]}]") for t in range(p.n)]
    _add_resources(m, p, iv)
    _add_staging(m, p, hint, start, unit)
    _add_memory(m, p, hint, start, end, horizon)
    makespan = m.new_int_var(0, horizon, "makespan")
    m.add_max_equality(makespan, end)
    m.minimize(makespan)
    for t in range(p.n):  # the greedy answer as hint
        m.add_hint(start[t], int(hint.start[t] / unit))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = 4 * time_limit_s  # wall-clock guard on a loaded machine
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    st = [solver.value(start[t]) * unit for t in range(p.n)]
    en = [st[t] + p.dur[t] for t in range(p.n)]
    return Schedule(st, en, max(en, default=0.0), "cpsat", dict(hint.staged), solver.status_name(status))


def _add_resources(m, p: ScheduleProblem, iv) -> None:
    # one transfer at a time per GPU per direction (send, receive), one local copy at a time
    per: dict[tuple[str, int], list] = {}
    for t in range(p.n):
        for r in task_resources(p, t):
            per.setdefault(r, []).append(iv[t])
    for r in sorted(per):
        if len(per[r]) > 1:
            m.add_no_overlap(per[r])


def _add_staging(m, p: ScheduleProblem, hint: Schedule, start, unit: float) -> None:
    # a staged GPU neither sends nor receives before its old state is on the host
    for t in range(p.n):
        ready = max(hint.staged.get(p.src[t], 0.0), hint.staged.get(p.dst[t], 0.0))
        if ready > 0:
            m.add(start[t] >= int(-(-ready // unit)))


def _add_memory(m, p: ScheduleProblem, hint: Schedule, start, end, horizon: int) -> None:
    # reservoir per tight GPU: +bytes at a receive's start, -bytes when a group's last reader ends
    incoming: dict[int, float] = {}
    for t in range(p.n):
        incoming[p.dst[t]] = incoming.get(p.dst[t], 0.0) + p.nbytes[t]
    mib = 2**20
    for g in sorted(incoming):
        base = p.base_mem.get(g, 0.0)
        if base + incoming[g] <= p.capacity:
            continue
        times, deltas = [0], [int(-(-base // mib))]
        if g in hint.staged:
            deltas[0] -= sum(b for gg, b, _ in p.free_groups if gg == g) // mib
        for t in range(p.n):
            if p.dst[t] == g:
                times.append(start[t])
                deltas.append(int(-(-p.nbytes[t] // mib)))
        for i, (gg, b, readers) in enumerate(p.free_groups):
            if gg == g and g not in hint.staged:
                freed = m.new_int_var(0, horizon, f"free[g{g},{i}]")
                m.add_max_equality(freed, [end[r] for r in readers])
                times.append(freed)
                deltas.append(-(b // mib))
        m.add_reservoir_constraint(times, deltas, 0, int(p.capacity // mib))
