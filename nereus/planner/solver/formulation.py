"""The one MILP formulation behind the CP-SAT and PuLP backends (see README.md, "Formulation").

Slots k = 0..n-1 (n = number of units) are candidate pools arranged as a forest: a slot's parent
has a lower index, a child is strictly smaller than its parent, and the sizes of a slot's children
sum to at most its size (top-level slots to at most the cluster). Such a forest always packs onto
buddy-aligned GPU ranges (assignment.place), and every buddy placement is such a forest, so the
positions themselves need no variables. The GPUs owned by slot k alone are covered by k and its
ancestors; makespans and memory are checked on each slot's chain of ancestors.
"""
from __future__ import annotations

from nereus.planner.solver.assignment import Assignment
from nereus.planner.solver.candidates import ACTOR, GEN, Tables
from nereus.planner.solver.linmodel import LinModel
from nereus.planner.solver.problem import PlanProblem


class Formulation:
    """Builds the LinModel and maps a backend's variable values back to an Assignment."""

    def __init__(self, problem: PlanProblem, t: Tables) -> None:
        self.p, self.t, self.m = problem, t, LinModel()
        self.n = len(t.units)
        self.K = range(self.n)
        self.U = range(self.n)
        self.t_hi = sum(max(sum(o.durations) for o in opts) for opts in t.options) + \
            max((max(o.sync) for o in t.options[t.unit_index(GEN)]), default=0.0)
        self.mem_hi = float(t.capacity_kib * 2 + sum(max(o.resident_kib for o in opts) for opts in t.options))
        sched = t.schedule
        self.sync_factor = 1.0 / sched.sync_every if sched.kind == "fully_async" else 1.0
        """Share of a weight sync each step pays (fully async: one sync every ``sync_every`` steps)."""
        self.add_assignment()
        self.add_tree()
        self.add_packing()
        self.add_options()
        self.add_makespans()
        self.add_memory()
        self.add_weight_sync()
        self.add_valid_cuts()
        self.add_placement_rules()
        if sched.is_async:
            self.add_async_schedule()

    def uname(self, u: int) -> str:
        return self.t.units[u].name

    # unit u sits in exactly one slot; used slots come first (slot renumbering symmetry)
    def add_assignment(self) -> None:
        m = self.m
        self.a = {(u, k): m.bool(f"a[{self.uname(u)},slot{k}]") for u in self.U for k in self.K}
        self.used = {k: m.bool(f"used[slot{k}]") for k in self.K}
        for u in self.U:
            m.add([(self.a[u, k], 1) for k in self.K], "==", 1)
            m.at_most_one([self.a[u, k] for k in self.K])
        for k in self.K:
            for u in self.U:
                m.add([(self.used[k], 1), (self.a[u, k], -1)], ">=", 0)
            m.add([(self.used[k], 1)] + [(self.a[u, k], -1) for u in self.U], "<=", 0)
            if k + 1 < self.n:
                m.add([(self.used[k], 1), (self.used[k + 1], -1)], ">=", 0)
        # slots are numbered by their lowest unit: unit u opens slot k only after slot k-1 is taken
        for u in self.U:
            for k in self.K:
                if k > u:
                    m.fix(self.a[u, k], 0)
                elif k >= 1:
                    m.add([(self.a[u, k], 1)] + [(self.a[v, k - 1], -1) for v in range(u)], "<=", 0)

    # slot sizes (one-hot) and the forest: every used slot is a root or has one parent that is
    # strictly larger (which also makes the parent relation acyclic)
    def add_tree(self) -> None:
        m, sizes = self.m, self.t.sizes
        others = lambda k: [j for j in self.K if j != k]  # noqa: E731
        self.sz = {(k, i): m.bool(f"size[slot{k},{s}]") for k in self.K for i, s in enumerate(sizes)}
        self.par = {(k, j): m.bool(f"parent[slot{k},slot{j}]") for k in self.K for j in others(k)}
        self.root = {k: m.bool(f"root[slot{k}]") for k in self.K}
        for k in self.K:
            m.at_most_one([self.sz[k, i] for i in range(len(sizes))])
            m.at_most_one([self.par[k, j] for j in others(k)] + [self.root[k]])
            m.add([(self.sz[k, i], 1) for i in range(len(sizes))] + [(self.used[k], -1)], "==", 0)
            m.add([(self.par[k, j], 1) for j in others(k)] + [(self.root[k], 1), (self.used[k], -1)], "==", 0)
            for j in others(k):
                m.add([(self.par[k, j], 1), (self.used[j], -1)], "<=", 0)
                # size index of child + 1 <= size index of parent
                m.add([(self.sz[k, i], i) for i in range(len(sizes))] + [(self.sz[j, i], -i) for i in range(len(sizes))],
                      "<=", -1, enforce=(self.par[k, j],))
        # anc[j,k]: slot j is an ancestor of (or is) slot k; unique fixpoint because parents are acyclic
        self.anc = {(k, k): self.used[k] for k in self.K}
        for k in self.K:
            for j in others(k):
                self.anc[j, k] = m.bool(f"anc[slot{j},slot{k}]")
        for k in self.K:
            for j in others(k):
                hops = [m.and_(f"via[slot{j},slot{i},slot{k}]", self.par[k, i], self.anc[j, i]) for i in others(k)]
                m.add([(self.anc[j, k], 1)] + [(h, -1) for h in hops], "==", 0)
        # cov[u,k]: unit u's pool covers the GPUs owned by slot k
        self.cov = {}
        for u in self.U:
            for k in self.K:
                parts = [m.and_(f"in[{self.uname(u)},slot{j},slot{k}]", self.a[u, j], self.anc[j, k]) for j in self.K]
                self.cov[u, k] = m.bool(f"cov[{self.uname(u)},slot{k}]")
                m.add([(self.cov[u, k], 1)] + [(x, -1) for x in parts], "==", 0)

    # children fit inside their parent; top-level pools fit the cluster
    def add_packing(self) -> None:
        m, sizes = self.m, self.t.sizes
        N = self.t.num_gpus
        self.gsz = {k: [(self.sz[k, i], s) for i, s in enumerate(sizes)] for k in self.K}
        load = {j: [] for j in [*self.K, -1]}
        for k in self.K:
            for j in [*(j for j in self.K if j != k), -1]:
                lit = self.par[k, j] if j >= 0 else self.root[k]
                v = m.new(f"load[slot{k},in{'root' if j < 0 else f'slot{j}'}]", 0, N, "count")
                m.add([(v, 1)] + [(x, -c) for x, c in self.gsz[k]], ">=", 0, enforce=(lit,))
                load[j].append((v, 1))
        for j in self.K:
            m.add(load[j] + [(x, -c) for x, c in self.gsz[j]], "<=", 0)
        m.add(load[-1], "<=", N)

    # one option per unit, of the size of the unit's slot
    def add_options(self) -> None:
        m, t = self.m, self.t
        self.z = {}
        for u in self.U:
            for oi, o in enumerate(t.options[u]):
                self.z[u, oi] = m.bool(f"x[{self.uname(u)},{o.size}gpu,{o.label},#{oi}]")
            m.add([(self.z[u, oi], 1) for oi in range(len(t.options[u]))], "==", 1)
            m.at_most_one([self.z[u, oi] for oi in range(len(t.options[u]))])
            for i, s in enumerate(t.sizes):
                terms = [(self.z[u, oi], 1) for oi, o in enumerate(t.options[u]) if o.size == s]
                for k in self.K:  # a[u,k] => (size of u's option == size of slot k)
                    m.add(terms + [(self.sz[k, i], -1)], "==", 0, enforce=(self.a[u, k],))
        self.dur = {(u, ph): [(self.z[u, oi], o.durations[ph]) for oi, o in enumerate(t.options[u])]
                    for u in self.U for ph in range(t.n_phases)}

    # phase makespan >= summed durations of the phase's units covering each slot's own GPUs
    def add_makespans(self) -> None:
        m, t = self.m, self.t
        self.ms = [m.new(f"makespan[phase{ph}]", 0, self.t_hi, "time") for ph in range(t.n_phases)]
        for ph in range(t.n_phases):
            units = [u for u in self.U if ph in t.units[u].phases]
            for k in self.K:
                parts = []
                for u in units:
                    hi = max(o.durations[ph] for o in t.options[u])
                    v = m.new(f"busy[{self.uname(u)},slot{k},phase{ph}]", 0, hi, "time")
                    m.add([(v, 1)] + [(x, -c) for x, c in self.dur[u, ph]], ">=", 0, "time", enforce=(self.cov[u, k],))
                    parts.append((v, 1))
                if len(units) > 1:
                    m.add([(self.ms[ph], 1)] + [(v, -1) for v, _ in parts], ">=", 0, "time")
                elif parts:
                    m.add([(self.ms[ph], 1), (parts[0][0], -1)], ">=", 0, "time")

    # residents of every unit homed on a slot's chain + the largest transient there <= capacity
    def add_memory(self) -> None:
        m, t = self.m, self.t
        res = {u: [(self.z[u, oi], o.resident_kib) for oi, o in enumerate(t.options[u])] for u in self.U}
        tra = {u: [(self.z[u, oi], o.transient_kib) for oi, o in enumerate(t.options[u])] for u in self.U}
        for k in self.K:
            rc = []
            for u in self.U:
                v = m.new(f"resident[{self.uname(u)},slot{k}]", 0, max(o.resident_kib for o in t.options[u]), "mem")
                m.add([(v, 1)] + [(x, -c) for x, c in res[u]], ">=", 0, "mem", enforce=(self.cov[u, k],))
                rc.append((v, 1))
            for w in self.U:
                m.add(rc + tra[w], "<=", t.capacity_kib, "mem", enforce=(self.cov[w, k],))

    # weight sync >= its value for the chosen (generation option, training pool size, colocation)
    def add_weight_sync(self) -> None:
        m, t = self.m, self.t
        g, tr = t.unit_index(GEN), t.unit_index(ACTOR)
        self.sync = m.new("weight_sync", 0, self.t_hi, "time")
        nest = {}
        for u, v in ((g, tr), (tr, g)):
            parts = [m.and_(f"inside[{self.uname(u)},{self.uname(v)},slot{k}]", self.a[u, k], self.cov[v, k]) for k in self.K]
            nest[u, v] = parts
        self.coloc = m.bool("colocated[actor/generation,actor/training]")
        sep = m.bool("separate[actor/generation,actor/training]")
        m.add([(self.coloc, 1), (sep, 1)], "==", 1)
        both = nest[g, tr] + nest[tr, g]
        for x in both:
            m.add([(self.coloc, 1), (x, -1)], ">=", 0)
        m.add([(self.coloc, 1)] + [(x, -1) for x in both], "<=", 0)
        tsize = {s: m.bool(f"train_size[{s}]") for s in t.sizes}
        m.add([(x, 1) for x in tsize.values()], "==", 1)
        for s, x in tsize.items():
            m.add([(x, 1)] + [(self.z[tr, oi], -1) for oi, o in enumerate(t.options[tr]) if o.size == s], "==", 0)
        for oi, o in enumerate(t.options[g]):
            for (s, col), val in zip(t.sync_keys, o.sync):
                if any(q.size == s for q in t.options[tr]):
                    m.add([(self.sync, 1)], ">=", val * self.sync_factor, "time",
                          enforce=(self.z[g, oi], tsize[s], self.coloc if col else sep))
        m.objective = [(x, 1.0) for x in self.ms] + [(self.sync, 1.0)]

    # redundant but LP-tightening: each unit alone bounds its phase; GPU-seconds of a phase fit in
    # makespan x cluster GPUs; the weight sync is at least its cheapest value for the chosen option
    def add_valid_cuts(self) -> None:
        m, t = self.m, self.t
        N = t.num_gpus
        for ph in range(t.n_phases):
            area = []
            for u in self.U:
                if ph in t.units[u].phases:
                    m.add([(self.ms[ph], 1)] + [(x, -c) for x, c in self.dur[u, ph]], ">=", 0, "time")
                    area += [(self.z[u, oi], o.durations[ph] * o.size / N) for oi, o in enumerate(t.options[u])]
            m.add([(self.ms[ph], 1)] + [(x, -c) for x, c in area], ">=", 0, "time")
        g = t.unit_index(GEN)
        m.add([(self.sync, 1)] + [(self.z[g, oi], -min(o.sync) * self.sync_factor) for oi, o in enumerate(t.options[g])],
              ">=", 0, "time")

    # asynchronous schedule: the rollout (generation) pool shares no GPU with any other unit, and a
    # step lasts as long as the slower side: step >= rollout, step >= experience + training; the
    # weight sync (x sync_factor) is added to either (planner.schedules.step_time)
    def add_async_schedule(self) -> None:
        m, t = self.m, self.t
        g = t.unit_index(GEN)
        assert g == 0, "the rollout unit opens slot 0"
        for v in self.U:
            if v != g:
                for k in self.K:
                    m.add([(self.cov[g, k], 1), (self.cov[v, k], 1)], "<=", 1)
        # the rollout is unit 0 and so slot 0 (slots are numbered by their lowest unit): a root alone
        for v in self.U:
            if v != g:
                m.fix(self.a[v, 0], 0)
        m.fix(self.root[0], 1)
        for k in self.K:
            if k != 0:
                m.fix(self.par[k, 0], 0)
        self.step = m.new("step[async]", 0, self.t_hi, "time")
        m.add([(self.step, 1), (self.ms[0], -1)], ">=", 0, "time")
        m.add([(self.step, 1)] + [(x, -1) for x in self.ms[1:]], ">=", 0, "time")
        # valid cut: the pools are disjoint and each is busy at most a step, so every unit's GPU-seconds
        # fit in step x cluster GPUs
        N = t.num_gpus
        area = [(self.z[u, oi], sum(o.durations) * o.size / N) for u in self.U for oi, o in enumerate(t.options[u])]
        m.add([(self.step, 1)] + [(x, -c) for x, c in area], ">=", 0, "time")
        # with the rollout size fixed at r (split.py's sub-problems) the trainer units share the
        # other N - r GPUs, so each phase's trainer GPU-seconds fit in its makespan x (N - r)
        rollout_sizes = {o.size for o in t.options[g]}
        if len(rollout_sizes) == 1 and N > min(rollout_sizes):
            rest = N - min(rollout_sizes)
            for ph in range(1, t.n_phases):
                area = [(self.z[u, oi], o.durations[ph] * o.size / rest) for u in self.U if u != g
                        for oi, o in enumerate(t.options[u]) if o.durations[ph]]
                if area:
                    m.add([(self.ms[ph], 1)] + [(x, -c) for x, c in area], ">=", 0, "time")
        m.objective = [(self.step, 1.0), (self.sync, 1.0)]

    def add_cutoff(self, upper: float) -> None:
        """Objective <= ``upper``: only plans at least as good as a known one stay feasible."""
        self.m.add(list(self.m.objective), "<=", upper, "time")

    def add_placement_rules(self) -> None:
        from nereus.planner.solver.structure import placement_skeleton

        m, sizes = self.m, self.t.sizes
        if self.p.constraints.placement == "disaggregated" and self.p.constraints.fixed_placement is None:
            for u in self.U:  # every unit alone in its own top-level pool
                m.fix(self.a[u, u], 1)
                m.fix(self.root[u], 1)
            return
        sk = placement_skeleton(self.p, self.t)
        if sk is None:
            return
        sk = canonical(sk.slot_size, sk.slot_parent, sk.unit_slot)
        for u, k in enumerate(sk[2]):
            m.fix(self.a[u, k], 1)
        for k, (s, par) in enumerate(zip(sk[0], sk[1])):
            m.fix(self.sz[k, sizes.index(s)], 1)
            m.fix(self.root[k] if par < 0 else self.par[k, par], 1)

    # ---- reading a solution back -------------------------------------------------------------
    def assignment(self, value) -> Assignment:
        """Assignment from ``value(var_index) -> float`` of a solved backend."""
        t = self.t
        on = lambda v: value(v) > 0.5  # noqa: E731
        slots = sorted({k for u in self.U for k in self.K if on(self.a[u, k])})
        renum = {k: i for i, k in enumerate(slots)}
        size = [next(s for i, s in enumerate(t.sizes) if on(self.sz[k, i])) for k in slots]
        parent = [next((renum[j] for j in self.K if j != k and on(self.par[k, j])), -1) for k in slots]
        unit_slot = [renum[next(k for k in self.K if on(self.a[u, k]))] for u in self.U]
        opts = [t.options[u][next(oi for oi in range(len(t.options[u])) if on(self.z[u, oi]))] for u in self.U]
        return Assignment(slot_size=tuple(size), slot_parent=tuple(parent), unit_slot=tuple(unit_slot),
                          unit_option=tuple(opts))

    def set_hint(self, a: Assignment) -> None:
        """Hint the skeleton and options of a known assignment (slots in the same numbering)."""
        h, t = self.m.hint, self.t
        size, parent, unit_slot = canonical(a.slot_size, a.slot_parent, a.unit_slot)
        for u in self.U:
            for k in self.K:
                h[self.a[u, k]] = float(unit_slot[u] == k)
            for oi, o in enumerate(t.options[u]):
                h[self.z[u, oi]] = float(o == a.unit_option[u])
        for k in self.K:
            used = k < len(size)
            h[self.used[k]] = float(used)
            for i, s in enumerate(t.sizes):
                h[self.sz[k, i]] = float(used and size[k] == s)
            h[self.root[k]] = float(used and parent[k] < 0)
            for j in self.K:
                if j != k:
                    h[self.par[k, j]] = float(used and parent[k] == j)


def canonical(slot_size, slot_parent, unit_slot) -> tuple[tuple, tuple, tuple]:
    """Renumber slots by their lowest unit (the symmetry-breaking order of the model)."""
    order = []
    for k in unit_slot:
        if k not in order:
            order.append(k)
    new = {k: i for i, k in enumerate(order)}
    return (tuple(slot_size[k] for k in order), tuple(new[slot_parent[k]] if slot_parent[k] >= 0 else -1 for k in order),
            tuple(new[k] for k in unit_slot))
