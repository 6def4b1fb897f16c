"""The forked workers' shared answers (``simulator/shared_cache.py``): a question is computed once,
by whichever worker asks first; another worker that asks it reads the answer (or waits for it), and
gets what it would have computed itself (issue 29, the simulator's speed)."""
import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

from nereus.planner.cost.params import CostParams
from nereus.planner.online.plan_cache import FREE, PlanCache
from nereus.planner.specs import GPU_PRESETS, ClusterSpec, load_job
from nereus.simulator import shared_cache
from nereus.simulator.shared_cache import SharedAnswers

JOB = load_job("examples/ppo-8b.yaml")
CLUSTER = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=2)


def test_an_answer_computed_in_one_cache_is_read_by_another():
    store = {}
    a, b = SharedAnswers(store, "plan"), SharedAnswers(store, "plan")
    assert "k" not in a  # nobody has it: a claims it and computes it
    assert isinstance(store[("plan", "k")], str)  # claimed, not answered
    a["k"] = 42
    assert "k" in b and b["k"] == 42 and b.hits == 1
    assert b.get("k") == 42 and b.get("other") is None  # get claims a miss like `in`
    assert isinstance(store[("plan", "other")], str)
    assert SharedAnswers(store, "bound").get("k") is None  # tags keep the caches apart


def test_a_question_another_worker_is_computing_is_waited_for():
    store = {("plan", "k"): "pending 1"}  # another process claimed it
    a = SharedAnswers(store, "plan")

    def answer():
        time.sleep(0.05)
        store[("plan", "k")] = (7, None)

    threading.Thread(target=answer).start()
    t0 = time.perf_counter()
    assert "k" in a and a["k"] == 7
    assert time.perf_counter() - t0 >= 0.04


def _counting_solver():
    from nereus.planner.solver import solve

    calls = []

    def fn(problem, **kw):
        calls.append(problem.workload.response_len_mean)
        return solve(problem, **kw)

    return fn, calls


def test_plan_caches_sharing_a_store_solve_each_question_once_and_agree():
    store = {}
    fn, calls = _counting_solver()
    caches = [PlanCache(JOB, CLUSTER, time_limit_s=2.0, seed=0, solve_fn=fn, deterministic=True) for _ in range(2)]
    prices = [SimpleNamespace(_seen={}) for _ in caches]
    for c, p in zip(caches, prices):
        shared_cache.share(c, p, store)
    w = JOB.workload()
    first = caches[0].best(FREE, w, 16, CostParams())
    second = caches[1].best(FREE, w, 16, CostParams())
    assert len(calls) == 1 and caches[0].solves == 1 and caches[1].solves == 0
    assert first is not None and second.key() == first.key()
    alone = PlanCache(JOB, CLUSTER, time_limit_s=2.0, seed=0, deterministic=True).best(FREE, w, 16, CostParams())
    assert alone.key() == first.key()  # what the second cache would have solved itself
    # an infeasible answer carries the message a local solve would have left
    assert caches[0].best(FREE, w, 1, CostParams()) is None
    caches[1].last_message = ""
    assert caches[1].best(FREE, w, 1, CostParams()) is None
    assert caches[1].last_message == caches[0].last_message != ""
    assert len(calls) == 2


def _ask(args):
    store, mean = args
    fn, calls = _counting_solver()
    c = PlanCache(JOB, CLUSTER, time_limit_s=2.0, seed=0, solve_fn=fn, deterministic=True)
    shared_cache.share(c, SimpleNamespace(_seen={}), store)
    w = JOB.workload().with_lengths(mean=mean, max_=JOB.workload().response_len_max)
    return c.best(FREE, w, 16, CostParams()).key(), len(calls)


def test_forked_workers_asking_the_same_questions_solve_each_once():
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        store = manager.dict()
        with ctx.Pool(2) as pool:
            out = pool.map(_ask, [(store, m) for m in (1000.0, 1000.0, 3000.0, 3000.0)])
    assert sum(n for _, n in out) == 2  # two distinct questions, four askers
    assert out[0][0] == out[1][0] and out[2][0] == out[3][0]
