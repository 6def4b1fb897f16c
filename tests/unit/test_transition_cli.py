"""`nereus transition` end to end on a tiny job: summary JSON (public contract), GraphML, errors."""
import json

import networkx as nx
import yaml

from nereus.cli import main
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ParallelConfig

HOME = {"actor": "actor/training", "critic": "critic/training", "ref": "ref/inference", "reward": "reward/inference"}
TINY = {"name": "tiny", "layers": 2, "hidden": 32, "ffn": 64, "heads": 4, "kv_heads": 2, "vocab": 64, "head_dim": 8}


def _plan(cfg: dict) -> dict:
    return Plan(stages=tuple(StagePlacement(name=HOME[r], config=ParallelConfig(tp=tp, pp=pp, dp=dp), pool=i,
                                            first_gpu=0, gpus=tp * pp * dp)
                             for i, (r, (tp, pp, dp)) in enumerate(cfg.items()))).to_dict()


def _files(tmp_path):
    job = {"algorithm": "ppo", "models": {r: TINY for r in HOME}, "batch": {"prompts": 8},
           "sequence": {"prompt_len": 16, "response_len_mean": 16, "response_len_max": 32}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"gpu": "h100-80gb", "nodes": 2, "gpus_per_node": 4}))
    (tmp_path / "a.json").write_text(json.dumps(_plan({"actor": (2, 2, 2), "critic": (2, 1, 4), "ref": (4, 1, 2),
                                                       "reward": (1, 1, 8)})))
    (tmp_path / "b.json").write_text(json.dumps(_plan({"actor": (4, 1, 2), "critic": (2, 2, 2), "ref": (2, 2, 2),
                                                       "reward": (2, 1, 4)})))
    return [f"--job={tmp_path / 'job.yaml'}", f"--cluster={tmp_path / 'cluster.yaml'}"]


def test_cli_writes_contract_json_and_graphml(tmp_path, capsys):
    base = _files(tmp_path)
    rc = main(["transition", *base, "--from", str(tmp_path / "a.json"), "--to", str(tmp_path / "b.json"),
               "--json", str(tmp_path / "out.json"), "--graph", str(tmp_path / "g.graphml"), "--scheduler", "greedy"])
    assert rc == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out) == {"bytes_moved", "bytes_kept", "makespan_s", "lower_bound_s", "peak_mem_frac", "ops", "plan_s"}
    assert out["bytes_moved"] > 0 and out["ops"] > 0 and out["makespan_s"] >= out["lower_bound_s"] > 0
    g = nx.read_graphml(tmp_path / "g.graphml")
    assert g.number_of_nodes() > 0 and nx.is_directed_acyclic_graph(g)
    text = capsys.readouterr().out
    assert "makespan / lower bound" in text and "bytes kept in place" in text


def test_cli_identity_and_bad_input(tmp_path, capsys):
    base = _files(tmp_path)
    rc = main(["transition", *base, "--from", str(tmp_path / "a.json"), "--to", str(tmp_path / "a.json"),
               "--json", str(tmp_path / "same.json")])
    assert rc == 0 and json.loads((tmp_path / "same.json").read_text())["bytes_moved"] == 0
    rc = main(["transition", *base, "--from", str(tmp_path / "missing.json"), "--to", str(tmp_path / "a.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "plan file not found" in err and "Traceback" not in err


def test_cli_warns_when_the_old_state_kept_until_commit_would_not_fit(tmp_path, capsys):
    """Between the schedule's peak (sources freed after their last read) and the keep-old peak
    (the executor's rollback), the transition schedules but the CLI says the executor would not fit."""
    base = _files(tmp_path)
    # the tiny transition peaks at ~205 KB scheduled and ~268 KB with the old state kept; usable = 240 KB
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"gpu": "h100-80gb", "nodes": 2, "gpus_per_node": 4,
                                                           "memory_gib": 2 + 240e3 / 2**30}))
    rc = main(["transition", *base, "--from", str(tmp_path / "a.json"), "--to", str(tmp_path / "b.json"),
               "--scheduler", "greedy"])
    text = capsys.readouterr().out
    assert rc == 0 and "warning" in text and "rollback" in text, text
