"""The demo's controllers and the single layouts of its baselines: the same online ``Controller``
the simulator uses, fed the run's real measured metrics, restricted to what the CPU executor runs
(TP 1/2/4 without PP, ZeRO-1, full recomputation or none, no sequence parallelism, every
model-stage colocated on all ranks).

How each policy's layout is chosen (``setup.POLICIES``), all by the planner on the same cost model:

- adaptive: the fastest plan for the first step's workload, then whatever the controller switches to;
- static: what a user would pick before the run, knowing its cap schedule but not its response
  lengths: the fastest plan for the largest cap with the job's nominal mean length, with actor
  generation on the training layout (no per-step weight sync), recomputation off;
- static+recompute: the same with recomputation allowed;
- model-hindsight: every plan the planner calls best for some step of the adaptive run (each step's
  measured mean, p90 and cap), every plan the adaptive run ran (``plan_spec`` of its records: where
  the planner finds nothing for the late steps' caps, the plans adaptive moved to there are the ones
  predicted to fit; without them, on a host whose probes price memory tighter, no candidate fitted
  every step and the A/A control did not run), plus the two static ones, is scored over all the run's steps by the
  cost model; the fastest in total among those predicted to fit every step wins. It knows the
  lengths (the first adaptive run's, not its own); its step times are the model's, not measured
  ones, hence "model". It runs unchanged: the controller observes and audits, but none of its
  decisions is applied (``DemoController(fixed=...)``), so its repetitions are the A/A control.
"""
from __future__ import annotations

from dataclasses import replace

from nereus.demo.setup import FIXED_POLICIES, DemoConfig, budget_for, cap_at
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.plan_cache import LayoutRule, PlanCache, static_rule
from nereus.planner.plan import Plan
from nereus.planner.solver.problem import CandidateSettings

GiB = 1024**3
DEMO_CANDIDATES = CandidateSettings(tps=(1, 2, 4), max_pp=1, micro_batches=(1, 2, 4, 8), zeros=(1,),
                                    recompute=(False, True), sps=(1,))
NO_RECOMPUTE = replace(DEMO_CANDIDATES, recompute=(False,))
COLOCATED = LayoutRule(name="adaptive", placement="colocated")


def candidates_for(policy: str, recompute: bool = True) -> CandidateSettings:
    return NO_RECOMPUTE if policy == "static" or not recompute else DEMO_CANDIDATES


def plan_cache(job, cluster, policy: str = "adaptive", recompute: bool = True) -> PlanCache:
    return PlanCache(job, cluster, time_limit_s=5.0, seed=0, candidates=candidates_for(policy, recompute))


def initial_plan(job, cluster, params, cfg: DemoConfig) -> Plan:
    """Fastest plan for the first step's workload (short responses)."""
    from nereus.errors import InfeasibleError

    w0 = job.workload().with_lengths(mean=4.0, max_=cap_at(cfg, 0))
    plan = plan_cache(job, cluster, recompute=cfg.recompute).best(COLOCATED, w0, cluster.num_gpus, params)
    if plan is None:
        raise InfeasibleError(f"demo: no plan fits a {budget_for(cfg):g} MB budget even for short responses; "
                              "raise --budget-mb")
    return plan


def static_plan(job, cluster, params, cfg: DemoConfig, policy: str = "static") -> tuple[Plan | None, int]:
    """(plan, cap it was sized for): the fastest plan with actor generation on the actor's training
    TP (no weight sync), for the run's largest cap at the job's nominal mean length; when none fits
    that, for the first cap (a user who hopes), else None."""
    cache = plan_cache(job, cluster, policy, cfg.recompute)
    caps = sorted({c for _, c in cfg.cap_schedule}, reverse=True)
    for cap in (caps[0], cap_at(cfg, 0)):
        w = job.workload().with_lengths(max_=cap)
        best = None
        for tp in DEMO_CANDIDATES.tps:
            rule = LayoutRule(name=f"{policy}-tp{tp}", placement="colocated",
                              fixed_tp_pp=(("actor/generation", tp, 1), ("actor/training", tp, 1)))
            p = cache.best(rule, w, cluster.num_gpus, params)
            if p is not None and (best is None or p.step_time_s < best.step_time_s):
                best = p
        if best is not None:
            return best, cap
    return None, 0


def step_workloads(job, records: list[dict]) -> list:
    """Each step's workload as it ran: measured mean and p90 response length, the cap in force."""
    return [replace(job.workload().with_lengths(mean=max(1.0, r["response_len_mean"]), max_=r["cap"]),
                    response_len_p90=min(float(r["cap"]), max(1.0, r["response_len_p90"]))) for r in records]


def hindsight_plan(job, cluster, params, records: list[dict], others: list[Plan],
                   recompute: bool = True) -> tuple[Plan | None, list[dict]]:
    """(best single plan for the run, the candidates with their predicted run time): see the module
    docstring. The candidates' total is the uncorrected model's step time summed over the steps."""
    from nereus.planner.cost.plan_times import compose_step, evaluate_times

    ws = step_workloads(job, records)
    cache = plan_cache(job, cluster, recompute=recompute)
    best = [cache.best(COLOCATED, w, cluster.num_gpus, params) for w in ws]
    ran = [Plan.from_dict(r["plan_spec"]) for r in records if r.get("plan_spec")]
    cands: dict[tuple, Plan] = {}
    for p in best + ran + list(others):
        if p is not None:
            cands.setdefault(p.layout_key() + tuple((s.name, s.config.micro_batch, s.config.recompute)
                                                     for s in p.stages), p)
    scored = []
    for p in cands.values():
        total, fits = 0.0, True
        for w in ws:
            t = evaluate_times(job, cluster, p, w, params)
            fits = fits and t.feasible
            total += compose_step(job, p, t.stage_s, t.weight_sync_s)
        scored.append({"plan": p, "predicted_run_s": total, "fits_every_step": fits})
    scored.sort(key=lambda c: (not c["fits_every_step"], c["predicted_run_s"]))
    best = scored[0]["plan"] if scored and scored[0]["fits_every_step"] else None
    return best, scored


FIXED_REASON = "not applied: a fixed-plan run (the A/A control runs one plan unchanged)"


class DemoController:
    """Adapts the run's per-step record (a dict) to ``Controller.step``. With ``fixed`` (a plan),
    the controller still observes every step (calibration, audit), but a switch it decides is
    reported back as not applied (``report_rollback``: audited with ``FIXED_REASON``) and the run
    stays on ``fixed``, knobs included."""

    def __init__(self, controller: Controller, fixed: Plan | None = None) -> None:
        self.controller, self.fixed = controller, fixed

    def step(self, rec: dict):
        m = StepMetrics(step=rec["step"], response_len_mean=max(1.0, rec["response_len_mean"]),
                        response_len_max=rec["cap"], response_len_p90=rec["response_len_p90"],
                        prompt_len=4, stage_times={k: v for k, v in rec["stage_times"].items()},
                        peak_mem_gib=rec["peak_mem_bytes"] / GiB, response_len_cap=rec["next_cap"], oom=rec["oom"])
        d = self.controller.step(m)
        if self.fixed is None or d.plan.key() == self.fixed.key():
            return d
        self.controller.report_rollback(FIXED_REASON, step=rec["step"])
        return replace(d, action="fixed", plan=self.fixed, transition=None,
                       reason=f"{FIXED_REASON}; the controller chose {d.action}: {d.reason}")

    def report_transition(self, seconds: float) -> None:
        self.controller.report_transition(seconds)

    def report_rollback(self, reason: str, step: int | None = None) -> None:
        self.controller.report_rollback(reason, step=step)

    def close(self) -> None:
        self.controller.close()


def make_demo_controller(policy: str, job, cluster, params, plan: Plan, cfg: DemoConfig) -> DemoController:
    """adaptive: free to change layout; every other policy keeps its plan's layout (TP/PP and pools),
    the controller still free to change knobs inside it (micro-batch; recomputation where allowed)."""
    # colocated, as the demo's worker runs every model on every rank: when a baseline's pools stop
    # fitting and its controller re-pools (a relaunch), the new pools are colocated too
    rule = COLOCATED if policy == "adaptive" else replace(static_rule(plan), placement="colocated")
    ctl = Controller(job, cluster, params=params, horizon=cfg.steps, margin=0.25, audit_path=audit_path(cfg, policy),
                     initial_plan=plan, total_steps=cfg.steps, rule=rule, plans=plan_cache(job, cluster, policy, cfg.recompute),
                     build_transition=False, patience=1, min_dwell=2, forecast_window=8, engine_restart_s=0.0)
    return DemoController(ctl, fixed=plan if policy in FIXED_POLICIES else None)


def audit_path(cfg: DemoConfig, policy: str, run: int | None = None) -> str:
    """``out_dir/audit-<policy>.jsonl`` for a policy's first run, ``audit-<policy>.r<i>.jsonl`` for
    its repetition ``i`` (``cfg.run`` unless given)."""
    i = cfg.run if run is None else run
    return f"{cfg.out_dir}/audit-{policy}{'' if i == 0 else f'.r{i}'}.jsonl"
