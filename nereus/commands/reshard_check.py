"""nereus reshard-check: random (plan A, plan B) pairs over a tiny model on real gloo processes.

Each case builds the seeded state in A, transitions to B with the planner's transition plan, and
checks every region bit for bit against the never-resharded reference and the logits in B
against A and the unsharded model (fp32: |diff| <= 1e-5, reduction order changes; bf16-mixed:
<= 2^-5 x the largest |logit|, see ``nereus.executor.checks.logits_tolerance``). ``--arch``: the
reference transformer (``--model`` preset) or a tiny Llama / Qwen2 (QKV bias, tied embeddings) /
Qwen3 (q/k norm) / Qwen3-MoE (8 experts, top 2; plans draw ep and etp too) from
``nereus.executor.hf.arch.TINY``; ``--precision bf16-mixed``: bf16 params
with fp32 master and Adam moments (the planner's default kinds). With ``--inject-fault [KIND]`` a
failure is injected in every case at a random round on a random rank (``before-send``: an
exception before the rank posts; ``after-receive``: an exception once its bytes arrived;
``corrupt``: one bit flipped in a message it receives; ``corrupt-pack``: one bit flipped in its
packed staging copy of an outgoing message, after packing (in a strided piece where one is
packed); ``corrupt-unpack``: one bit flipped in a piece it unpacked into its destination region;
``kill``: its process dies of SIGKILL;
``hang``: it stops answering past ``--timeout``; no KIND: ``before-send`` or ``hang`` at random).
A case passes when every rank rolled back to checksums identical to before (for ``kill``: every
surviving rank); exit 0 when every case passed, 1 otherwise, 2 on bad input.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` set) the processes are
torchrun's, joined by env:// rendezvous, instead of spawned ones; rank 0 prints and writes the JSON
(see docs/torchrun.md). ``--backend nccl`` keeps every tensor on the rank's GPU (``cuda:LOCAL_RANK``).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from nereus.commands.common import console, nonneg_int, pos_int, torchrun_world, write_json

ARCHS = ("reference", "llama", "qwen2", "qwen3", "qwen3_moe")
PRECISIONS = ("fp32", "bf16-mixed")
FAULTS = {"before-send": "raise", "after-receive": "after-receive", "corrupt": "corrupt",
          "corrupt-pack": "corrupt-pack", "corrupt-unpack": "corrupt-unpack", "kill": "kill", "hang": "hang"}
"""``--inject-fault`` choices -> ``FaultSpec.kind``."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("reshard-check", help="check transitions bit for bit on real gloo processes",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=pos_int, default=4, help="processes (2-8; default 4)")
    p.add_argument("--cases", type=pos_int, default=4, help="random (A, B) plan pairs")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--model", default="tiny-4l-128h", help="model preset for --arch reference (tiny ones only on CPU)")
    p.add_argument("--arch", choices=ARCHS, default="reference",
                   help="reference transformer (--model) or a tiny Hugging Face architecture (default reference)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 state, or bf16 params with fp32 master and moments (default fp32)")
    p.add_argument("--inject-fault", nargs="?", const="random", default=None, metavar="KIND",
                   choices=("random", *FAULTS),
                   help=f"inject a failure in every case; pass = rollback. KIND: {', '.join(FAULTS)} "
                        "(default: before-send or hang at random)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo (CPU tensors) or nccl (every tensor on cuda:LOCAL_RANK; needs one GPU per rank)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a rank waits for a peer (default 5)")
    p.add_argument("--json", metavar="OUT", help="write {cases, passed, failed, bytes_moved, seconds}")
    return p


def random_plan(rng: random.Random, world: int, model):
    """A random placement of the actor (and ref, on the same pool) over part or all of the world."""
    from nereus.executor.scenario import make_plan

    if model.is_moe:
        from nereus.executor.hf.scenarios import random_moe_plan

        return random_moe_plan(rng, world, model)
    sizes = [g for g in (1, 2, 4, 8) if g <= world]
    g = rng.choice(sizes)
    first = rng.choice([f for f in range(0, world - g + 1)])
    tps = [t for t in (1, 2, 4) if g % t == 0 and t <= model.kv_heads and model.heads % t == 0 and model.ffn % t == 0]
    tp = rng.choice(tps)
    pps = [p for p in (1, 2, 4) if (g // tp) % p == 0 and p <= model.layers]
    pp = rng.choice(pps)
    return make_plan(tp=tp, pp=pp, dp=g // (tp * pp), first_gpu=first, zero=rng.choice((0, 1)),
                     micro_batch=rng.choice((1, 2)))


def _label(plan) -> str:
    s = plan.home("actor")
    return f"{s.config.label()}z{s.config.zero}@gpu{s.first_gpu}"


def _make_cases(args, job):
    from nereus.executor.scenario import local_cluster
    from nereus.planner.transition.build import plan_transition

    rng = random.Random(args.seed)
    model, cases = job.model("actor"), []
    while len(cases) < args.cases:
        a, b = random_plan(rng, args.world, model), random_plan(rng, args.world, model)
        if a.layout_key() == b.layout_key() and all((x.config.ep, x.config.etp) == (y.config.ep, y.config.etp)
                                                    for x, y in zip(a, b)):
            continue
        tp = plan_transition(job, local_cluster(args.world), a, b, mixed_precision=args.precision == "bf16-mixed",
                             scheduler="greedy")
        if tp.rounds:
            cases.append((a, b, tp))
    return rng, cases


def _moe_rounding_moves(case) -> bool:
    """An MoE case under bf16 where A or B splits attention or an expert over ranks (tp or etp > 1):
    bf16 router logits tie exactly often enough (measured: a top-2/top-3 gap of 0.0 in one of the
    48 tokens of a seeded batch) that moving roundings flips a token's top-k, a discrete change of
    its output, so the logits are reported, not held to the dense tolerance; bits still must be exact.
    (EP-only and dp/pp changes gave identical bf16 logits; fp32 holds every case to 1e-5.)"""
    return any(max(s.config.tp, s.config.etp) > 1 for s in (case[0].home("actor"), case[1].home("actor")))


def _verdict(results: list[dict], fault: bool, precision: str = "fp32", logits_reported_only: bool = False
             ) -> tuple[bool, str]:
    """(passed, why) of one case from every rank's result. With a fault every rank must have
    rolled back to its old checksums (a rank killed on purpose, ``{"killed": True}``, is skipped;
    the survivors must roll back); without one, every region must be bit-exact and the logits in
    B, compared on at least one rank, within tolerance."""
    from nereus.executor.checks import logits_tolerance

    if fault:
        alive = [r for r in results if not (isinstance(r, dict) and r.get("killed"))]
        ok = bool(alive) and all(isinstance(r, dict) and r["rolled_back"] and r["checksums_equal"] for r in alive)
        who = "every surviving rank" if len(alive) < len(results) else "all ranks"
        return ok, f"{who} rolled back, checksums identical" if ok else "rollback incomplete"
    errors = [r["error"] for r in results if r["rolled_back"]]
    if errors:  # the rank that failed, not the peers that rolled back because it did
        return False, "rolled back: " + next((e for e in errors if "another rank" not in e), errors[0])
    bad = sum(len(r["mismatches"]) for r in results)
    compared = [r for r in results if r["compared_logits"]]
    if not compared:  # a pass needs the logits in B checked somewhere, not merely no rank objecting
        return False, f"bits {'ok' if bad == 0 else f'{bad} regions differ'}, logits not compared (no rank ran B)"
    diff = max((r["logits_max_diff"] for r in compared), default=0.0)
    tol = logits_tolerance(precision, max((r["logits_scale"] for r in compared), default=0.0))
    ok = bad == 0 and (diff <= tol or logits_reported_only)
    note = " (reported only: bf16 MoE router ties)" if logits_reported_only and diff > tol else ""
    return ok, (f"bits {'ok' if bad == 0 else f'{bad} regions differ'}, logits max diff {diff:.1e} "
                f"(tolerance {tol:.1e}){note}")


def _job(args):
    from nereus.executor.scenario import tiny_job
    from nereus.models.spec import preset

    if args.arch == "reference":
        return tiny_job(preset(args.model))
    from nereus.executor.hf.arch import TINY, spec_of

    return tiny_job(spec_of(TINY[args.arch], name=f"tiny-{args.arch}"))


def _fault_for(rng: random.Random, choice: str, tp, world: int, timeout_s: float):
    """The fault of one case. ``corrupt``, ``corrupt-unpack`` and ``after-receive`` hit a rank
    where bytes arrive (a receiver of a cross-rank piece, in that piece's round), ``corrupt-pack``
    a sender; both corruptions of staging copies pick a piece below the bucket size, which always
    travels packed (the fault also fires in a later exchange of that rank if need be). The
    others hit any rank and round."""
    from nereus.executor.apply import FaultSpec
    from nereus.executor.transport import BUCKET_BYTES

    kind = rng.choice(("raise", "hang")) if choice == "random" else FAULTS[choice]
    if kind in ("corrupt", "after-receive", "corrupt-pack", "corrupt-unpack"):
        moves = [op for op in tp.ops if not op.is_copy]
        if kind in ("corrupt-pack", "corrupt-unpack"):
            moves = [op for op in moves if op.region.nbytes < BUCKET_BYTES] or moves
        op = rng.choice(moves)
        rank, rnd = (op.src_gpu if kind == "corrupt-pack" else op.dst_gpu), op.round
    else:
        rank, rnd = rng.randrange(world), rng.randrange(tp.rounds)
    return FaultSpec(rank=rank, round=rnd, kind=kind, hang_s=2 * timeout_s if kind == "hang" else 0.0)


def _fault_runs(args, job, cases, rng, torchrun: bool) -> list[list]:
    """Per case, every rank's result (a killed rank: ``{"killed": True}``)."""
    from nereus.executor.apply import STAGING_BYTES
    from nereus.executor.checks import reshard_case, reshard_fault_cases
    from nereus.executor.launch import HUNG, launch

    for i, (a, b, tp) in enumerate(cases):
        cases[i] = (a, b, tp, _fault_for(rng, args.inject_fault, tp, args.world, args.timeout))
    if torchrun:  # one process group for every case: no kill (it would end torchrun's job), see run()
        out = launch(reshard_fault_cases, args.world, job, cases, args.seed, args.timeout, args.precision,
                     timeout_s=120 + 30 * len(cases), backend=args.backend, allow_hung=True,
                     pg_timeout_s=_pg_timeout_s(args, cases))
        return None if out is None else [[o[i] if o is not HUNG else {"rolled_back": False} for o in out]
                                         for i in range(len(cases))]
    per_case = []
    for i, (a, b, tp, fault) in enumerate(cases):
        out = launch(reshard_case, args.world, job, a, b, tp, args.seed + i, fault, args.timeout, STAGING_BYTES,
                     args.precision, timeout_s=60 + 4 * args.timeout, allow_hung=True, backend=args.backend,
                     pg_timeout_s=_pg_timeout_s(args, [cases[i]]))
        per_case.append([{"killed": True} if o is HUNG and fault.kind == "kill" and r == fault.rank
                         else o if o is not HUNG else {"rolled_back": False} for r, o in enumerate(out)])
    return per_case


def _pg_timeout_s(args, cases) -> float:
    """The process-group timeout: 60 s on gloo; on NCCL above the worst case of the longest
    transition (``vote.nccl_pg_timeout_s``), so the watchdog never acts before the rollback."""
    from nereus.executor.reshard.vote import nccl_pg_timeout_s

    if args.backend != "nccl":
        return 60.0
    return nccl_pg_timeout_s(args.timeout, max(c[2].rounds for c in cases))


def run(args: argparse.Namespace) -> int:
    from nereus.errors import SpecError
    from nereus.executor.checks import reshard_cases
    from nereus.executor.launch import launch

    env = torchrun_world(args.world)
    if env is None and not 2 <= args.world <= 8:
        raise SpecError(f"--world must be between 2 and 8 processes on this machine, got {args.world}")
    if env is not None and args.inject_fault == "kill":
        raise SpecError("--inject-fault kill needs spawned processes (a fresh world per case); under torchrun a "
                        "killed rank ends the job: run it without torchrun")
    if args.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise SpecError("--backend nccl needs CUDA GPUs, and torch.cuda.is_available() is False here")
        if env is None and torch.cuda.device_count() < args.world:
            raise SpecError(f"--backend nccl needs one GPU per rank: --world {args.world}, "
                            f"{torch.cuda.device_count()} GPU(s) visible")
    job = _job(args)
    con = console()
    t0 = time.perf_counter()
    rng, cases = _make_cases(args, job)
    where = "torchrun" if env is not None else "spawned"
    with con.status(f"running {len(cases)} case(s) on {args.world} {where} {args.backend} processes"):
        if args.inject_fault:
            per_case = _fault_runs(args, job, cases, rng, env is not None)
        else:
            out = launch(reshard_cases, args.world, job, cases, args.seed, args.timeout, args.precision,
                         timeout_s=120 + 30 * len(cases), backend=args.backend, pg_timeout_s=_pg_timeout_s(args, cases))
            per_case = None if out is None else [[out[r][i] for r in range(args.world)] for i in range(len(cases))]
    if per_case is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    passed, first_failure = 0, ""
    for i, (case, results) in enumerate(zip(cases, per_case)):
        loose = job.model("actor").is_moe and args.precision != "fp32" and _moe_rounding_moves(case)
        ok, why = _verdict(results, bool(args.inject_fault), args.precision, loose)
        passed += ok
        first_failure = first_failure or ("" if ok else f"case {i + 1}: {why}")
        extra = f" fault {case[3].kind} on rank {case[3].rank} round {case[3].round}:" if args.inject_fault else ""
        con.print(f"case {i + 1}: {_label(case[0])} -> {_label(case[1])}  {case[2].bytes_moved / 1e6:.2f} MB in "
                  f"{case[2].rounds} round(s){extra} {'[green]PASS[/]' if ok else '[red]FAIL[/]'} ({why})",
                  soft_wrap=True)
    seconds = time.perf_counter() - t0
    failed = len(cases) - passed
    con.print(f"{passed} passed, {failed} failed ({seconds:.1f} s)")
    write_json(args.json, {"cases": len(cases), "passed": passed, "failed": failed,
                           "bytes_moved": int(sum(c[2].bytes_moved for c in cases)), "seconds": seconds})
    if failed:
        print(f"nereus reshard-check: {failed} of {len(cases)} case(s) failed; first: {first_failure}", file=sys.stderr)
    return 0 if failed == 0 else 1
