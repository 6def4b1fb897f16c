"""``deterministic``: CP-SAT's limit counts work, not seconds, so a solve cut by its limit returns the
same plan on an idle and on a loaded machine (the simulator's plans, and so its SIMULATED figures,
no longer depend on what else the machine runs)."""
import subprocess
import sys

from nereus.planner.cost.params import CostParams
from nereus.planner.online.plan_cache import FREE, PlanCache
from nereus.planner.solver import PlanProblem, solve
from nereus.planner.solver import backends
from nereus.planner.specs import load_cluster, load_job
from nereus.simulator.simulate import SIM_CANDIDATES

JOB = load_job("examples/ppo-8b.yaml")
CLUSTER = load_cluster("examples/cluster-h100-128n.yaml")


def _problem(gpus=1024, mean=2000):
    w = JOB.workload().with_lengths(mean=mean, max_=20480)
    return PlanProblem(job=JOB, cluster=CLUSTER.with_gpus(gpus), workload=w, params=CostParams(),
                       candidates=SIM_CANDIDATES)


def test_a_cut_deterministic_solve_returns_the_same_plan_under_load():
    p = _problem()
    # 0.002 s of deterministic time: the fixpoint bound pruning and the nested greedy templates prove
    # this instance OPTIMAL within 0.005, so the limit is below that to keep it cut
    quiet = solve(p, time_limit_s=0.002, deterministic=True)
    assert quiet.status == "FEASIBLE"  # cut by its limit: where it stops is what is being tested
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = [solve(p, time_limit_s=0.002, deterministic=True) for _ in range(2)]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    for s in loaded:
        assert s.status == quiet.status and s.objective == quiet.objective and s.bound == quiet.bound
        assert s.plan.stages == quiet.plan.stages


def test_the_flag_reaches_cp_sat_and_the_simulators_plan_cache_sets_it(monkeypatch):
    seen = []
    real = backends.solve_cpsat

    def spy(*a, **k):
        seen.append(a[5] if len(a) > 5 else k.get("deterministic", False))
        return real(*a, **k)

    monkeypatch.setattr(backends, "solve_cpsat", spy)
    solve(_problem(gpus=64), time_limit_s=2.0, deterministic=True)
    first = len(seen)  # the thinned warm start and the full model: every CP-SAT call of a solve
    solve(_problem(gpus=64, mean=3000), time_limit_s=2.0)
    assert first >= 1 and len(seen) > first
    assert all(seen[:first]) and not any(seen[first:])
    asked = []

    def fn(problem, **kw):
        asked.append(kw.get("deterministic", False))
        return solve(problem, **kw)

    PlanCache(JOB, CLUSTER, time_limit_s=2.0, solve_fn=fn, deterministic=True).best(FREE, JOB.workload(), 64, CostParams())
    PlanCache(JOB, CLUSTER, time_limit_s=2.0, solve_fn=fn).best(FREE, JOB.workload(), 64, CostParams())
    assert asked == [True, False]
    from nereus.simulator import simulate as sim
    from nereus.simulator.trace import parse_trace

    made = []

    class Recording(PlanCache):
        def __init__(self, *a, **k):
            made.append(k.get("deterministic", False))
            super().__init__(*a, **k)

    monkeypatch.setattr(sim, "PlanCache", Recording)
    trace = parse_trace("step,response_len_mean,response_len_max,gpus\n0,1500,8192,64\n2,1500,8192,64\n")
    sim.simulate(JOB, CLUSTER, trace, ["static"], time_limit_s=2.0, seed=0)
    assert made == [True]
