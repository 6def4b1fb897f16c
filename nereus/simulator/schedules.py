"""The transfers of a transition A -> B, as the transition planner plans them, handed to the ground
truth to price on its own links (``truth.network.replay``): the truth never imports the planner's
transition code, this module does.

Up to ``SCHEDULE_MAX_GPUS`` GPUs: the greedy schedule of ``build_transition`` (transfer buckets in the
order of their planned start). Above it (scheduling one layout change on 1,024 GPUs takes tens of
seconds of CPU): the planner's pieces and source choice without a schedule, as one transfer per
(source GPU, destination GPU) pair, largest first (the order the greedy scheduler queues them).
Cached per layout pair.
"""
from __future__ import annotations

from nereus.planner.plan import Plan
from nereus.planner.specs import ClusterSpec, JobSpec

SCHEDULE_MAX_GPUS = 128


class TransitionSchedules:
    """``schedules(a, b)`` -> [(src GPU, dst GPU, bytes), ...] (see the module docstring)."""

    def __init__(self, job: JobSpec, cluster: ClusterSpec, max_scheduled_gpus: int = SCHEDULE_MAX_GPUS) -> None:
        self.job, self.cluster, self.max_scheduled_gpus = job, cluster, max_scheduled_gpus
        self._cache: dict[tuple, list[tuple[int, int, float]]] = {}

    def __call__(self, a: Plan, b: Plan) -> list[tuple[int, int, float]]:
        key = (a.layout_key(), b.layout_key())
        hit = self._cache.get(key)
        if hit is None:
            gpus = max(a.num_gpus, b.num_gpus)
            cluster = self.cluster if gpus == self.cluster.num_gpus else self.cluster.with_gpus(
                -(-gpus // self.cluster.gpus_per_node) * self.cluster.gpus_per_node if gpus >= self.cluster.gpus_per_node
                else gpus)
            hit = self._cache[key] = (self._scheduled(cluster, a, b) if gpus <= self.max_scheduled_gpus
                                      else self._pairs(cluster, a, b))
        return hit

    def _scheduled(self, cluster: ClusterSpec, a: Plan, b: Plan) -> list[tuple[int, int, float]]:
        from nereus.planner.transition.build import build_transition

        res = build_transition(self.job, cluster, a, b, scheduler="greedy", materialize=False)
        p, s = res.problem, res.schedule
        order = sorted(range(p.n), key=lambda t: (s.start[t], t))
        return [(p.src[t], p.dst[t], float(p.nbytes[t])) for t in order]

    def _pairs(self, cluster: ClusterSpec, a: Plan, b: Plan) -> list[tuple[int, int, float]]:
        from nereus.planner.transition.pieces import choose_sources, compute_pieces, link_bandwidths

        pieces = compute_pieces(self.job, a, b, skip_unchanged=True)
        bw_intra, bw_inter = link_bandwidths(cluster)
        choose_sources(pieces, cluster, bw_intra, bw_inter)
        pairs: dict[tuple[int, int], float] = {}
        for m in pieces.moves:
            pairs[(m[5], m[1])] = pairs.get((m[5], m[1]), 0.0) + float(m[6])
        return [(s, d, nb) for (s, d), nb in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))]
