"""`nereus plan`: the JSON contract, the table, infeasibility (exit 2) and the sweep."""
import json
import subprocess
import sys

from nereus.planner.plan import Plan

JOB8, JOB70 = "examples/ppo-8b.yaml", "examples/ppo-70b.yaml"
ONE_NODE = "examples/cluster-h100-1n.yaml"


def nereus(*args):
    return subprocess.run([sys.executable, "-m", "nereus.cli", *args], capture_output=True, text=True, timeout=300)


def test_plan_json_contract_and_table(tmp_path):
    out = tmp_path / "plan.json"
    r = nereus("plan", "--job", JOB8, "--cluster", ONE_NODE, "--time-limit", "20", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "model-stage" in r.stdout and "predicted step time" in r.stdout and "mem/GPU" in r.stdout
    d = json.loads(out.read_text())
    assert d["status"] in ("OPTIMAL", "FEASIBLE") and d["backend"] == "cpsat"
    assert d["step_time_s"] > 0 and d["solve_s"] > 0 and d["gap"] >= 0
    names = [s["name"] for s in d["model_stages"]]
    assert set(names) == {"actor/generation", "actor/inference", "critic/inference", "ref/inference",
                          "reward/inference", "actor/training", "critic/training"}
    for s in d["model_stages"]:
        assert {"name", "tp", "pp", "dp", "pool", "gpus", "time_s", "mem_gib"} <= set(s)
        assert s["tp"] * s["pp"] * s["dp"] == s["gpus"] and s["mem_gib"] <= 78.0
    plan = Plan.from_dict(d)  # the input format of later commands
    assert plan.step_time_s == d["step_time_s"]


def test_plan_infeasible_exit_2_with_binding_constraint(tmp_path):
    out = tmp_path / "plan.json"
    r = nereus("plan", "--job", JOB70, "--cluster", ONE_NODE, "--json", str(out))
    assert r.returncode == 2
    assert "actor/training needs >=" in r.stderr and "GiB usable" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert json.loads(out.read_text())["status"] == "INFEASIBLE"


def test_plan_sweep_table_json_and_png(tmp_path):
    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    r = nereus("plan", "--job", JOB8, "--cluster", ONE_NODE, "--sweep", "response-len-mean=1024:4096:x2",
               "--plot", str(png), "--json", str(js))
    assert r.returncode == 0, r.stderr
    assert "response-len-mean" in r.stdout and "4096" in r.stdout
    rows = json.loads(js.read_text())
    assert [row["response-len-mean"] for row in rows] == [1024, 2048, 4096]
    times = [row["step_time_s"] for row in rows]
    assert all(t is not None for t in times) and times[0] < times[1] < times[2]  # longer responses, slower steps
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_bad_sweep_exit_2():
    r = nereus("plan", "--job", JOB8, "--cluster", ONE_NODE, "--sweep", "colour=1:2:x2")
    assert r.returncode == 2 and "unknown knob" in r.stderr and "Traceback" not in r.stderr


def test_a_table_written_to_a_pipe_keeps_its_figures(monkeypatch, capsys):
    """Piped (not a terminal, ``COLUMNS`` unset), rich would squeeze tables to 80 columns and
    ``nereus simulate``'s eleven columns to ellipses: the console is PIPE_WIDTH wide there, and
    ``COLUMNS`` still rules when set."""
    from rich.table import Table

    from nereus.commands.common import PIPE_WIDTH, console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert console().width == PIPE_WIDTH
    t = Table(*[f"column {i}" for i in range(11)])
    t.add_row(*[f"{1000 + i}.25" for i in range(11)])
    console().print(t)
    out = capsys.readouterr().out
    assert all(f"{1000 + i}.25" in out for i in range(11)), out
    monkeypatch.setenv("COLUMNS", "90")
    assert console().width == 90
