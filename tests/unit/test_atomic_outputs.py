"""Every file the CLI writes (--json, --out, --plot, --graph, --audit, --csv, --report, profiles)
arrives whole: written to a temporary file beside it, then moved onto it with ``os.replace``.
A write that fails leaves the previous file as it was and no temporary file behind."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
from pathlib import Path

import pytest

from nereus.cli import main

ROOT = Path(__file__).resolve().parents[2]
JOB, CLUSTER = str(ROOT / "examples/ppo-8b.yaml"), str(ROOT / "examples/cluster-h100-4n.yaml")
PLAN = str(ROOT / "tests/data/plan_ppo8b_4n.json")
WANDB = str(ROOT / "tests/data/wandb_export.csv")
SPECS = ["--job", JOB, "--cluster", CLUSTER]

# (id, argv with {d} for the output folder, outputs written)
COMMANDS = [
    ("estimate", ["estimate", *SPECS, "--model-stage", "actor/training", "--tp", "2", "--dp", "16", "--json", "{d}/e.json"],
     ["e.json"]),
    ("plan-sweep", ["plan", *SPECS, "--backend", "greedy", "--sweep", "response-len-mean=1024:2048:x2",
                    "--json", "{d}/sweep.json", "--plot", "{d}/sweep.png"], ["sweep.json", "sweep.png"]),
    ("plan-emit", ["plan", *SPECS, "--backend", "greedy", "--emit", "verl", "--out", "{d}/launch.sh",
                   "--json", "{d}/plan.json"], ["plan.json", "launch.sh"]),
    ("transition", ["transition", *SPECS, "--from", PLAN, "--to", PLAN, "--json", "{d}/t.json",
                    "--graph", "{d}/t.graphml"], ["t.json", "t.graphml"]),
    ("simulate", ["simulate", *SPECS, "--trace", "{d}/../trace.csv", "--policy", "adaptive", "--time-limit", "0.5",
                  "--audit", "{d}/audit.jsonl", "--json", "{d}/sim.json", "--csv", "{d}/steps.csv",
                  "--plot", "{d}/sim.png"], ["audit.jsonl", "sim.json", "steps.csv", "sim.png"]),
    ("calibrate-logs", ["calibrate", "--from-logs", WANDB, *SPECS, "--out", "{d}/profile.json",
                        "--report", "{d}/report.md"], ["report.md", "profile.json"]),
    ("fidelity", ["fidelity", "--json", "{d}/fid.json", "--plot", "{d}/fid.png"], ["fid.json", "fid.png"]),
    ("fit-profiles", ["fit-profiles", "--gpu", "h200", "--out", "{d}"], ["h200.json"]),
]


def run(argv: list[str], out_dir: Path) -> tuple[int, str]:
    (out_dir.parent / "trace.csv").write_text("step,response_len_mean,response_len_max,gpus\n0,1000,4096,32\n"
                                              "1,1500,4096,32\n")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([a.format(d=out_dir) for a in argv])
    return code, err.getvalue()


@pytest.mark.parametrize("argv, outputs", [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_every_output_arrives_by_os_replace_from_a_temporary_file_beside_it(argv, outputs, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    moves: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def recording_replace(src, dst, *a, **kw):
        moves.append((Path(src), Path(dst)))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", recording_replace)
    code, err = run(argv, out_dir)
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(outputs)  # nothing else: no temporary file left
    for name in outputs:
        target = out_dir / name
        srcs = [src for src, dst in moves if dst == target]
        assert len(srcs) == 1, f"{name} was not written by one os.replace: {moves}"
        assert srcs[0].parent == out_dir and srcs[0].name.startswith(f".{name}") and not srcs[0].exists()
        assert target.stat().st_size > 0


@pytest.mark.parametrize("argv, outputs", [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_a_failed_write_exits_2_in_one_line_and_leaves_the_old_files(argv, outputs, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for name in outputs:
        (out_dir / name).write_text("OLD")

    def full_disk(src, dst, *a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full_disk)
    code, err = run(argv, out_dir)
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("nereus ")]  # simulate's progress bar aside
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(rf"cannot write (profile )?{re.escape(str(out_dir / outputs[0]))}: No space left on device",
                     lines[0]), err
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(outputs)  # the temporary file is gone
    assert all((out_dir / name).read_text() == "OLD" for name in outputs)


def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_in_one_line(tmp_path):
    code, err = run(["plan", *SPECS, "--backend", "greedy", "--sweep", "response-len-mean=1024:2048:x2",
                     "--plot", str(tmp_path / "out" / "sweep.xyz")], tmp_path / "out")
    assert code == 2 and "no figure format .xyz" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
