"""The demo's controllers: the same online ``Controller`` the simulator uses, fed the run's real
measured metrics, restricted to what the CPU executor runs (TP 1/2/4 without PP, ZeRO-1, no
recomputation, no sequence parallelism, every model-stage colocated on all ranks)."""
from __future__ import annotations

from dataclasses import replace

from nereus.demo.setup import DemoConfig, cap_at
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.plan import Plan
from nereus.planner.online.plan_cache import LayoutRule, PlanCache, static_rule
from nereus.planner.solver.problem import CandidateSettings

GiB = 1024**3
DEMO_CANDIDATES = CandidateSettings(tps=(1, 2, 4), max_pp=1, micro_batches=(1, 2, 4, 8), zeros=(1,),
                                    recompute=(False,), sps=(1,))
COLOCATED = LayoutRule(name="adaptive", placement="colocated")


def plan_cache(job, cluster) -> PlanCache:
    return PlanCache(job, cluster, time_limit_s=5.0, seed=0, candidates=DEMO_CANDIDATES)


def initial_plan(job, cluster, params, cfg: DemoConfig) -> Plan:
    """Fastest plan for the first step's workload (short responses)."""
    from nereus.errors import InfeasibleError

    w0 = job.workload().with_lengths(mean=4.0, max_=cap_at(cfg, 0))
    plan = plan_cache(job, cluster).best(COLOCATED, w0, cluster.num_gpus, params)
    if plan is None:
        raise InfeasibleError(f"demo: no plan fits a {cfg.budget_mb:g} MB budget even for short responses; "
                              "raise --budget-mb")
    return plan


class DemoController:
    """Adapts the run's per-step record (a dict) to ``Controller.step``."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def step(self, rec: dict):
        m = StepMetrics(step=rec["step"], response_len_mean=max(1.0, rec["response_len_mean"]),
                        response_len_max=rec["cap"], response_len_p90=rec["response_len_p90"],
                        prompt_len=4, stage_times={k: v for k, v in rec["stage_times"].items()},
                        peak_mem_gib=rec["peak_mem_bytes"] / GiB, response_len_cap=rec["next_cap"], oom=rec["oom"])
        return self.controller.step(m)

    def report_transition(self, seconds: float) -> None:
        self.controller.report_transition(seconds)

    def close(self) -> None:
        self.controller.close()


def make_demo_controller(policy: str, job, cluster, params, plan: Plan, cfg: DemoConfig) -> DemoController:
    rule = COLOCATED if policy == "adaptive" else static_rule(plan)
    audit = f"{cfg.out_dir}/audit-{policy}.jsonl"
    ctl = Controller(job, cluster, params=params, horizon=cfg.steps, margin=0.25, audit_path=audit,
                     initial_plan=plan, total_steps=cfg.steps, rule=rule, plans=plan_cache(job, cluster),
                     build_transition=False, patience=1, min_dwell=2, forecast_window=8)
    return DemoController(ctl)
