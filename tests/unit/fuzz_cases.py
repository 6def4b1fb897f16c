"""Hostile inputs for every file Nereus reads: the generators shared by
``tests/unit/test_fuzz_inputs.py`` (200+ cases per reader, derandomized) and
``benchmarks/fuzz_inputs.py`` (2,000+ per reader); ``fuzz_harness.py`` feeds them and checks the
contract.

A case is the bytes of one file. Most start from a valid document that is then damaged: a field
set to a hostile value (NaN, inf, 10^400, a string for a number, a list for a mapping, a bool for
an int), a field removed or added, a contradiction (response mean above the cap, p90 above max,
steps going backwards, 10^9 nodes); the rest replace the whole file (random bytes, non-UTF-8
text, an empty file, a truncated one, nesting 20,000 deep, a 5,000-digit number).
"""
from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from hypothesis import strategies as st

from fuzz_harness import finite_problems
from nereus.errors import NereusError

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples/ppo-8b.yaml"
CLUSTER = ROOT / "examples/cluster-h100-4n.yaml"
PLAN = ROOT / "tests/data/plan_ppo8b_4n.json"
CORPUS = ROOT / "nereus/calibration/published"

NAN, INF = float("nan"), float("inf")


# ---- hostile values --------------------------------------------------------------------------------
SPECIAL_NUMBERS = (0, -1, 1, 2, 3, 7, 2**31, 10**9, 10**18, 2**63, 10**30, 10**400, NAN, INF, -INF, 1e308,
                   -1e308, 5e-324, -0.0, 0.5, 1.5, 1e-300, 1e9, 1e30)
SPECIAL_TEXT = ("", " ", "nan", "NaN", "inf", "-inf", "Infinity", "1e999", "12", "-5", "0x10", "1_000", "1,5",
                "true", "null", "None", "\x00", "é", "\U0001F680", "a" * 300, "step:1 - ", "{", "[", "\"",
                "np.float64(nan)", "np.float64(inf)", "10**9", "1000000000", "1" * 400, "h100-80gb", "actor/training")


def hostile_value() -> st.SearchStrategy:
    """A value for a field of a JSON/YAML document: special numbers, any float, a bool, None, text,
    a list or a mapping."""
    return st.one_of(
        st.sampled_from(SPECIAL_NUMBERS), st.integers(-10**6, 10**6), st.floats(), st.booleans(), st.none(),
        st.sampled_from(SPECIAL_TEXT), st.text(max_size=8),
        st.lists(st.integers(-3, 3), max_size=3),
        st.dictionaries(st.sampled_from(["a", "nodes", "tp", "name", "1"]), st.integers(-3, 3), max_size=2))


def hostile_cell() -> st.SearchStrategy[str]:
    """A CSV cell or a log value as text."""
    return st.one_of(st.sampled_from(SPECIAL_TEXT), st.sampled_from(SPECIAL_NUMBERS).map(repr),
                     st.integers(-10**12, 10**12).map(str), st.floats().map(repr), st.text(max_size=6))


# ---- damaging a document ---------------------------------------------------------------------------
UNKNOWN_KEYS = ("extra", "nodes", "tp", "gpus", "params", "1", "")


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _put(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _delete(doc: Any, path: tuple) -> Any:
    if path:
        del _get(doc, path[:-1])[path[-1]]
    return doc


def _retype(v: Any) -> Any:
    if isinstance(v, dict):
        return list(v.values())
    if isinstance(v, list):
        return {str(i): x for i, x in enumerate(v)}
    return [v]


@st.composite
def damaged(draw, bases: tuple, edits: tuple = ()) -> Any:
    """One of ``bases`` (deep-copied) after 1-3 damages: set a field to a hostile value, delete it,
    add an unknown one, turn a mapping into a list (or back), or apply one of ``edits``
    ((path, value): a contradiction the reader must catch)."""
    doc = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(("set", "set", "set", "delete", "add", "retype", "edit", "edit", "edit")))
        if op == "edit" and edits:
            path, value = draw(st.sampled_from(edits))
            try:
                doc = _put(doc, path, copy.deepcopy(value))
            except (KeyError, IndexError, TypeError):
                pass  # an earlier damage removed the parent
            continue
        path = draw(st.sampled_from(_paths(doc)))
        if op in ("set", "edit"):
            doc = _put(doc, path, draw(hostile_value()))
        elif op == "delete":
            doc = _delete(doc, path)
        elif op == "add" and isinstance(_get(doc, path), dict):
            _get(doc, path)[draw(st.sampled_from(UNKNOWN_KEYS))] = draw(hostile_value())
        elif op == "retype":
            doc = _put(doc, path, _retype(_get(doc, path)))
    return doc


GENERIC_JUNK = (b"", b"\n\n\n", b"[" * 20000, b"{" * 20000, b"- " * 5000 + b"a", b"1" * 5000, b"-" + b"9" * 5000,
                b"\x00" * 64, b"\xff\xfe\x00a\x00b", b"\xef\xbb\xbf{}", b"null", b"[]", b"0", b'"text"', b"NaN",
                b"\x1b[31mstep:1 - timing_s/gen:1\x1b[0m", b"\r\r\r", "caf\u00e9".encode("latin-1"))
YAML_JUNK = (b"!!python/object/apply:os.system ['true']\n", b"a: *missing\n", b"a: [unclosed\n", b"a:\n\t- 1\n",
             b"---\na: 1\n---\nb: 2\n", b"a: &x [1, 2]\nb: [*x, *x, *x]\n", b"? [1, 2]\n: 3\n", b"%YAML 9.9\n---\na: 1\n",
             b"a: 1\na: 2\n", b"nodes: 1" + b"0" * 5000 + b"\ngpu: h100-80gb\n", b"{a: 1, b: [2, {c: d}]}\n")


@st.composite
def _corrupted(draw, texts: st.SearchStrategy[str]) -> bytes:
    data = draw(texts).encode()
    how = draw(st.sampled_from(("truncate", "latin1", "nul", "bom", "crlf", "splice")))
    cut = draw(st.integers(0, len(data)))
    if how == "truncate":
        return data[:cut]
    if how == "latin1":
        return data[:cut] + b"\xe9\xff" + data[cut:]
    if how == "nul":
        return data[:cut] + b"\x00" + data[cut:]
    if how == "bom":
        return b"\xef\xbb\xbf" + data
    if how == "crlf":
        return data.replace(b"\n", b"\r\n")
    return data[:cut] + draw(st.binary(max_size=16)) + data[cut:]


def file_bytes(texts: st.SearchStrategy[str], junk: tuple = ()) -> st.SearchStrategy[bytes]:
    """Bytes of a file: a damaged document (most cases), the same corrupted at byte level, or a
    file that is no document at all."""
    doc = texts.map(str.encode)
    return st.one_of(doc, doc, doc, doc, doc, doc, doc, doc, _corrupted(texts), _corrupted(texts),
                     st.binary(max_size=300), st.text(max_size=200).map(str.encode),
                     st.sampled_from(GENERIC_JUNK + junk))


def _yaml(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def _json(doc: Any) -> str:
    return json.dumps(doc, indent=1)  # NaN / Infinity / -Infinity tokens on purpose: Python reads them


def _csv(rows: list[list[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


@st.composite
def damaged_table(draw, header: list[str], rows: list[list[str]], edits: tuple = ()) -> list[list[str]]:
    """A CSV table (header + rows of text) after 1-4 damages: a hostile cell, rows deleted, swapped
    (steps going backwards) or duplicated, a column dropped or added, a short row, or one of
    ``edits`` ((column, value): a contradiction)."""
    table = [list(header)] + [list(r) for r in rows]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("cell", "cell", "cell", "edit", "edit", "delete_row", "swap", "dup",
                                   "drop_col", "add_col", "short")))
        nrows = len(table)
        if op == "cell" or (op == "edit" and not edits):
            r, c = draw(st.integers(0, nrows - 1)), draw(st.integers(0, max(len(table[0]) - 1, 0)))
            if c < len(table[r]):
                table[r][c] = draw(hostile_cell())
        elif op == "edit":
            col, value = draw(st.sampled_from(edits))
            if col in table[0] and nrows > 1:
                r = draw(st.integers(1, nrows - 1))
                c = table[0].index(col)
                if c < len(table[r]):
                    table[r][c] = value
        elif op == "delete_row" and nrows > 1:
            del table[draw(st.integers(1, nrows - 1))]
        elif op == "swap" and nrows > 2:
            i, j = draw(st.integers(1, nrows - 1)), draw(st.integers(1, nrows - 1))
            table[i], table[j] = table[j], table[i]
        elif op == "dup" and nrows > 1:
            i = draw(st.integers(1, nrows - 1))
            table.insert(i, list(table[i]))
        elif op == "drop_col" and table[0]:
            c = draw(st.integers(0, len(table[0]) - 1))
            for row in table:
                if c < len(row):
                    del row[c]
        elif op == "add_col":
            name = draw(st.sampled_from(("extra", "gpus", "_step", "timing_s/gen", "")))
            table[0].append(name)
            for row in table[1:]:
                row.append(draw(hostile_cell()))
        elif op == "short" and nrows > 1:
            table[draw(st.integers(1, nrows - 1))].pop()
    return table


# ---- the documents each reader is fed ----------------------------------------------------------------
TINY_MODEL = {"name": "tiny", "layers": 4, "hidden": 512, "ffn": 1376, "heads": 8, "kv_heads": 4, "vocab": 32000,
              "head_dim": 64}
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512,
             "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
             "head_dim": 64, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
JOBS = (
    yaml.safe_load(JOB.read_text()),
    {"algorithm": "grpo", "models": {"actor": {"hf_config": "config.json"}, "ref": {"preset": "llama-3.1-8b"},
                                      "reward": TINY_MODEL},
     "batch": {"prompts": 64, "samples_per_prompt": 8, "ppo_epochs": 1, "mini_batches": 2},
     "sequence": {"prompt_len": 512, "response_len_mean": 1500.5, "response_len_max": 4096, "response_len_p90": 3000},
     "rollout": {"engine": "sglang", "gpu_memory_utilization": 0.8, "max_num_seqs": 128, "sleep": False}},
)
JOB_EDITS = (
    (("sequence", "response_len_mean"), 100000), (("sequence", "response_len_p90"), 9000),
    (("sequence", "response_len_max"), 10**12), (("sequence", "prompt_len"), 10**15),
    (("batch", "mini_batches"), 10**6), (("batch", "prompts"), 10**9), (("batch", "samples_per_prompt"), 1),
    (("algorithm",), "grpo"), (("algorithm",), "ppo"), (("algorithm",), "PPO"),
    (("models", "actor"), "no-such-model"), (("models", "actor"), {**TINY_MODEL, "kv_heads": 3}),
    (("models", "actor"), {**TINY_MODEL, "layers": 10**9, "hidden": 10**12}),
    (("models", "actor"), {"hf_config": "/nonexistent/config.json"}), (("models", "actor"), {"hf_config": "."}),
    (("models", "actor"), {"hf_config": "a\x00b"}), (("models", "actor"), {"hf_config": "x" * 5000}),
    (("models", "critic"), "llama-3.1-8b"), (("rollout",), {"engine": "tgi"}),
    (("rollout",), {"gpu_memory_utilization": 1.5}), (("rollout",), {"max_num_seqs": 10**18}),
    (("sequence", "response_len_mean"), NAN), (("sequence", "response_len_p90"), INF),
    (("rollout",), {"gpu_memory_utilization": NAN}), (("models", "reward"), {**TINY_MODEL, "rope_theta": INF}),
)
CLUSTERS = (
    yaml.safe_load(CLUSTER.read_text()),
    {"gpu": "my-gpu", "nodes": 2, "gpus_per_node": 4, "memory_gib": 96, "tflops_bf16": 500, "hbm_tbps": 3.0,
     "intra_node_gbps": 400, "inter_node_gbps": 50, "reserved_gib": 2},
)
ABSURD_CLUSTERS = ({"gpu": "h100-80gb", "nodes": 10**9, "gpus_per_node": 8},
                   {"gpu": "h100-80gb", "nodes": 1, "gpus_per_node": 10**9},
                   {"gpu": "h100-80gb", "nodes": 10**9, "gpus_per_node": 10**9})
CLUSTER_EDITS = (
    ((), ABSURD_CLUSTERS[0]), ((), ABSURD_CLUSTERS[1]), ((), ABSURD_CLUSTERS[2]),
    (("nodes",), 10**9), (("gpus_per_node",), 10**9), (("nodes",), 0), (("gpus_per_node",), 3),
    (("gpu",), "tpu-v9"), (("memory_gib",), 1), (("reserved_gib",), 200), (("memory_gib",), 1e-300),
    (("tflops_bf16",), 1e308), (("inter_node_gbps",), 5e-324), (("gpu",), "H100-80GB"),
    (("memory_gib",), NAN), (("hbm_tbps",), INF), (("reserved_gib",), NAN), (("nodes",), 4.0),
)
HF_EDITS = (
    (("num_attention_heads",), 0), (("num_attention_heads",), 7), (("num_key_value_heads",), 3),
    (("head_dim",), None), (("hidden_size",), 500), (("num_key_value_heads",), 0), (("rope_parameters",), [1]),
    (("rope_theta",), "fast"), (("rms_norm_eps",), -1), (("vocab_size",), 10**30), (("model_type",), ["qwen3"]),
    (("rope_theta",), NAN), (("rms_norm_eps",), INF), (("hidden_size",), 512.0), (("tie_word_embeddings",), "no"),
)


def _plan_doc() -> dict:
    return json.loads(PLAN.read_text())


PLAN_EDITS = (
    (("model_stages", 0, "dp"), 4), (("model_stages", 1, "first_gpu"), 8), (("model_stages", 0, "gpus"), 10**9),
    (("model_stages", 0), {"name": "actor/generation", "tp": 1, "pp": 1, "dp": 10**9, "pool": 0, "gpus": 10**9}),
    (("model_stages", 2, "name"), "actor/inference"), (("model_stages", 3, "name"), "actor"),
    (("model_stages", 3, "name"), "x/y"), (("model_stages", 4, "pool"), 1), (("status",), "INFEASIBLE"),
    (("model_stages",), []), (("model_stages", 5, "zero"), 7), (("model_stages", 5, "recompute"), "no"),
    (("model_stages", 0, "first_gpu"), 10**12), (("gap",), "Infinity"), (("step_time_s",), NAN),
    (("model_stages", 1, "time_s"), NAN), (("model_stages", 2, "mem_gib"), INF), (("gap",), INF),
)
PARAMS_EDITS = (
    (("mfu_train",), 1.5), (("hbm_eff",), 0), (("stage_factor",), {"generation": 0}),
    (("stage_factor",), {"warp": 1.0}), (("stage_factor",), "fast"), (("engine_overhead",), {"vllm": [1]}),
    (("engine_overhead",), {"vllm": [NAN, 0.1]}), (("workspace_gib",), INF), (("kv_mem_util",), NAN),
    (("act_coeff_hidden",), 10**400), (("decode_step_overhead_s",), True),
    (("workspace_gib",), NAN), (("host_link_gbps",), INF), (("stage_factor",), {"training": INF}),
)


def _profile_doc() -> dict:
    return json.loads((ROOT / "nereus/calibration/profiles/h200.json").read_text())


PROFILE_EDITS = tuple((("params",) + p, v) for p, v in PARAMS_EDITS) + (
    (("version",), 2), (("version",), "1"), (("hardware", "reserved_gib"), 500), (("hardware", "memory_gib"), NAN),
    (("hardware", "gpus_per_node"), 10**9), (("hardware", "sources"), [1, 2]), (("fit",), [1]), (("where",), "x"),
    (("hardware", "name"), 5), (("hardware", "tflops_bf16"), INF),
)
TRACE_HEADER = ["step", "response_len_mean", "response_len_max", "gpus", "response_len_p90", "prompt_len_mean",
                "response_len_cap"]
TRACE_ROWS = [["0", "1000", "4096", "32", "2000", "512", "8192"], ["2", "1500.5", "6000", "16", "3000", "600", "8192"],
              ["5", "2500", "8192", "32", "", "", "8192"]]
TRACE_EDITS = (("response_len_mean", "9000"), ("response_len_p90", "9000"), ("response_len_max", "9000"),
               ("step", "1"), ("step", "0"), ("step", "-3"), ("step", "1.5"), ("gpus", "1000000000"),
               ("response_len_cap", "100"), ("prompt_len_mean", "nan"), ("prompt_len_mean", "-5"),
               ("response_len_mean", "nan"), ("gpus", "0"), ("step", "100000"))
LOG_RECORDS = [
    {"step": i, "timing_s/gen": 50.0 + i, "timing_s/old_log_prob": 5.5, "timing_s/ref": 5.3, "timing_s/values": 5.4,
     "timing_s/reward": 5.2, "timing_s/update_actor": 23.0, "timing_s/update_critic": 22.8,
     "response_length/mean": 1900.0 + 40 * i, "response_length/max": 8192, "prompt_length/mean": 1024,
     "actor/pg_loss": 0.01} for i in range(1, 6)]
LOG_EDITS = (
    (("response_length/mean",), 20000), (("response_length/max",), 10), (("timing_s/gen",), -1),
    (("timing_s/gen",), 1e308), (("prompt_length/mean",), 10**9), (("step",), -5), (("step",), 10**18),
    (("response_length/mean",), NAN), (("timing_s/update_actor",), INF), (("response_length/max",), 10**30),
    (("timing_s/reward",), 3.2e-282), (("timing_s/gen",), 0),
)
CORPUS_HEADER = ["id", "source", "source_kind", "hardware", "gpus", "model", "engine", "config", "metric", "unit",
                 "value", "derived", "split", "notes"]


def _corpus_rows() -> list[list[str]]:
    rows = list(csv.reader((CORPUS / "decode.csv").read_text().splitlines()))
    assert rows[0] == CORPUS_HEADER, rows[0]
    return rows[1:4]


CORPUS_EDITS = (("value", "nan"), ("value", "inf"), ("value", "-1"), ("value", "0"), ("gpus", "1e9"),
                ("gpus", "-8"), ("split", "test"), ("derived", "2"), ("config", "tp"), ("config", "=1"),
                ("config", "tp=1;;pp=abc"), ("id", ""), ("hardware", "tpu"), ("model", "a" * 500))


def _jsonl(records: Any) -> str:
    if not isinstance(records, list):
        return json.dumps(records)
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _verl_console(records: Any) -> str:
    """Records as verl console lines (``(TaskRunner pid=7) step:N - key:value - ...``)."""
    if not isinstance(records, list):
        records = [records]
    lines = ["2025-06-17 10:00:01,123\tINFO worker.py:1888 -- Started a local Ray instance."]
    for r in records:
        if not isinstance(r, dict):
            lines.append(str(r))
            continue
        step = r.get("step", "?")
        body = " - ".join(f"{k}:{v!r}" if isinstance(v, float) else f"{k}:{v}" for k, v in r.items() if k != "step")
        lines.append(f"(TaskRunner pid=2412) step:{step} - {body}")
    return "\n".join(lines) + "\n"


def _records_table(records: list[dict], wandb: bool) -> tuple[list[str], list[list[str]]]:
    keys = [k for k in records[0] if k != "step"]
    header = (["_step", "_runtime", "_timestamp"] if wandb else ["step"]) + keys
    rows = [([str(r["step"]), f"{118.2 * r['step']:.1f}", f"{1750154401.5 + 118 * r['step']:.1f}"] if wandb
             else [str(r["step"])]) + [str(r[k]) for k in keys] for r in records]
    return header, rows


@st.composite
def _log_lines(draw, render: Callable[[Any], str]) -> str:
    """Damaged records, rendered; sometimes a line replaced by junk."""
    text = render(draw(damaged((LOG_RECORDS,), tuple(((i,) + p, v) for i in range(len(LOG_RECORDS))
                                                      for p, v in LOG_EDITS))))
    if draw(st.booleans()):
        lines = text.splitlines()
        if lines:
            i = draw(st.integers(0, len(lines) - 1))
            junk = ("step:3 - timing_s/gen", "step:x - a:1", "step:4 - timing_s/gen:np.float64(nan)", "[1, 2]", "{",
                    "step:5 - response_length/mean:1e999 - timing_s/gen:1", "\x1b[2K\x1b[1Gstep:6 - timing_s/gen:1")
            lines[i] = draw(st.one_of(st.text(max_size=40), st.sampled_from(junk))).replace("\n", " ")
            text = "\n".join(lines) + "\n"
    return text


# ---- known bugs in others' modules ----------------------------------------------------------------
# Inputs that hit a bug pinned as a strict xfail in tests/unit/test_fuzz_inputs.py go here as
# (matcher(data) -> bool, reason): the fuzz skips them (the benchmark counts them apart) so that it
# keeps testing everything else. Empty: the trace reader's and the oracle's bugs found this way are fixed
# (their tests in test_fuzz_inputs.py now pass as plain tests).
KNOWN_BUGS: dict[str, tuple] = {}


def known_bug(reader: str, data: bytes) -> str | None:
    return next((why for hit, why in KNOWN_BUGS.get(reader, ()) if hit(data)), None)


# ---- readers ---------------------------------------------------------------------------------------
def _check_job(job) -> list[str]:
    return finite_problems(job.to_dict()) + [p for _, m in job.models for p in finite_problems(m.to_dict(), m.name)]


def _check_plan(plan) -> list[str]:
    core = {k: v for k, v in plan.to_dict().items() if k in ("step_time_s", "solve_s", "model_stages")}
    bad = finite_problems(core)
    for s in plan.stages:
        role, _, stage = str(s.name).partition("/")
        if role not in ("actor", "critic", "ref", "reward") or stage not in ("generation", "inference", "training"):
            bad.append(f"model-stage name {s.name!r}")
    return bad


def _check_log(table) -> list[str]:
    import numpy as np

    values = table.frame.to_numpy(dtype=float)
    bad = [] if not np.isinf(values).any() else ["an infinite value in the table"]
    if (values[~np.isnan(values)] < 0).any():
        bad.append("a negative value in the table")
    return bad + ([] if len(table.frame) else ["no rows"])


def _check_trace(trace) -> list[str]:
    return [p for r in trace.rows for p in finite_problems(r.to_dict(), f"step {r.step}")]


def _check_corpus(rows) -> list[str]:
    return [f"{r.id}: value {r.value}" for r in rows if not (math.isfinite(r.value) and r.value > 0)] + \
           [f"{r.id}: gpus {r.gpus}" for r in rows if r.gpus < 0]


def _read_log(path: Path, fmt: str = "auto"):
    """Both modes: ``strict`` must refuse or read; the lenient read is the result."""
    from nereus.calibration.logs import read_log

    with contextlib.suppress(NereusError):
        read_log(path, fmt=fmt, strict=True)
    return read_log(path, fmt=fmt)


def _write_hf_config(folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))


def _write_job_for_hf(folder: Path) -> None:
    (folder / "hf_job.yaml").write_text(_yaml({**JOBS[1], "models": {"actor": {"hf_config": "hostile_config.json"},
                                                                      "ref": "llama-3.1-8b"}}))


@dataclass(frozen=True)
class Reader:
    name: str
    filename: str
    """Name of the damaged file in the case folder (its stem must appear in every error)."""
    cases: st.SearchStrategy[bytes]
    read: Callable[[Path], Any]
    check: Callable[[Any], list[str]]
    """Problems with a parsed object (empty: sane)."""
    setup: Callable[[Path], None] = lambda folder: None
    """Writes the valid files the case needs beside the damaged one."""
    cli: tuple[tuple[str, Callable[[Path, Path], list[str]]], ...] = ()
    """(label, argv from (damaged file, output file)): CLI commands that read the file."""
    target: Callable[[Path], Path] = field(default=lambda path: path)
    """What the reader is given (a file, or its folder for a corpus)."""


def _job_cases():
    return file_bytes(damaged(JOBS, JOB_EDITS).map(_yaml), YAML_JUNK)


def _readers() -> dict[str, Reader]:
    import nereus.calibration.logs  # noqa: F401  (pandas: imported once here, not inside a timed case)
    from nereus.calibration.profile import load_profile
    from nereus.fidelity.corpus import load_corpus, load_file
    from nereus.models.spec import from_hf_config
    from nereus.planner.cost.params import CostParams
    from nereus.planner.plan import Plan
    from nereus.planner.specs import load_cluster, load_job
    from nereus.simulator.trace import load_trace

    job, cluster = str(JOB), str(CLUSTER)
    estimate = ["estimate", "--model-stage", "actor/generation"]
    plan = ["plan", "--backend", "greedy", "--time-limit", "2"]
    calibrate = lambda f, o: ["calibrate", "--from-logs", str(f), "--job", job, "--cluster", cluster,  # noqa: E731
                              "--out", str(o)]
    table = lambda header, rows, edits: damaged_table(header, rows, edits).map(_csv)  # noqa: E731
    log_csv = _records_table(LOG_RECORDS, wandb=False)
    log_wandb = _records_table(LOG_RECORDS, wandb=True)
    csv_edits = tuple((k[0], str(v)) for k, v in LOG_EDITS)
    wandb_edits = tuple((k[0].replace("step", "_step"), str(v)) for k, v in LOG_EDITS)
    corpus_rows = _corpus_rows()
    readers = [
        Reader("job_yaml", "hostile_job.yaml", _job_cases(), load_job, _check_job, setup=_write_hf_config,
               cli=(("estimate", lambda f, o: estimate + ["--job", str(f), "--cluster", cluster, "--json", str(o)]),
                    ("plan", lambda f, o: plan + ["--job", str(f), "--cluster", cluster, "--json", str(o)]))),
        Reader("cluster_yaml", "hostile_cluster.yaml",
               file_bytes(damaged(CLUSTERS + ABSURD_CLUSTERS, CLUSTER_EDITS).map(_yaml), YAML_JUNK),
               load_cluster, lambda c: finite_problems(c.to_dict()) + finite_problems(
                   [c.gpu.memory_gib, c.gpu.tflops_bf16, c.gpu.hbm_tbps, c.gpu.reserved_gib]),
               cli=(("estimate", lambda f, o: estimate + ["--job", job, "--cluster", str(f), "--json", str(o)]),
                    ("plan", lambda f, o: plan + ["--job", job, "--cluster", str(f), "--json", str(o)]))),
        Reader("hf_config", "hostile_config.json", file_bytes(damaged((HF_CONFIG,), HF_EDITS).map(_json)),
               from_hf_config, lambda m: finite_problems(m.to_dict()), setup=_write_job_for_hf,
               cli=(("estimate", lambda f, o: estimate + ["--job", str(f.parent / "hf_job.yaml"), "--cluster", cluster,
                                                          "--json", str(o)]),)),
        Reader("trace_csv", "hostile_trace.csv", file_bytes(table(TRACE_HEADER, TRACE_ROWS, TRACE_EDITS)),
               load_trace, _check_trace,
               cli=(("simulate", lambda f, o: ["simulate", "--job", job, "--cluster", cluster, "--trace", str(f),
                                               "--policy", "static", "--steps", "2", "--time-limit", "0.5",
                                               "--json", str(o)]),)),
        Reader("plan_json", "hostile_plan.json", file_bytes(damaged((_plan_doc(),), PLAN_EDITS).map(_json)),
               Plan.load, _check_plan,
               cli=(("transition", lambda f, o: ["transition", "--job", job, "--cluster", cluster, "--from", str(f),
                                                 "--to", str(PLAN), "--json", str(o)]),)),
        Reader("profile_json", "hostile_profile.json", file_bytes(damaged((_profile_doc(),), PROFILE_EDITS).map(_json)),
               load_profile, lambda p: finite_problems(p.params.to_dict()) + finite_problems(p.hardware.to_dict()),
               cli=(("estimate", lambda f, o: estimate + ["--job", job, "--cluster", cluster, "--profile", str(f),
                                                          "--json", str(o)]),)),
        Reader("params_json", "hostile_params.json",
               file_bytes(damaged(({"params": CostParams().to_dict()}, CostParams().to_dict()),
                                  PARAMS_EDITS + tuple((("params",) + p, v) for p, v in PARAMS_EDITS)).map(_json)),
               CostParams.load, lambda p: finite_problems(p.to_dict()),
               cli=(("estimate", lambda f, o: estimate + ["--job", job, "--cluster", cluster, "--profile", str(f),
                                                          "--json", str(o)]),)),
        Reader("log_jsonl", "hostile_log.jsonl", file_bytes(_log_lines(_jsonl)), _read_log, _check_log,
               cli=(("calibrate", calibrate),)),
        Reader("log_csv", "hostile_log.csv", file_bytes(table(*log_csv, csv_edits)), _read_log, _check_log,
               cli=(("calibrate", calibrate),)),
        Reader("log_verl_console", "hostile_verl.log", file_bytes(_log_lines(_verl_console)), _read_log, _check_log,
               cli=(("calibrate", calibrate),)),
        Reader("log_wandb_csv", "hostile_wandb.csv", file_bytes(table(*log_wandb, wandb_edits)), _read_log,
               _check_log, cli=(("calibrate", calibrate),)),
        Reader("corpus_file", "hostile_corpus.csv", file_bytes(table(CORPUS_HEADER, corpus_rows, CORPUS_EDITS)),
               lambda p: load_file(p, "decode"), _check_corpus),
        Reader("corpus_dir", "decode.csv", file_bytes(table(CORPUS_HEADER, corpus_rows + corpus_rows[:1], CORPUS_EDITS)),
               load_corpus, _check_corpus, target=lambda p: p.parent,
               cli=(("fidelity", lambda f, o: ["fidelity", "--corpus", str(f.parent), "--json", str(o)]),)),
    ]
    return {r.name: r for r in readers}


READERS = _readers()


def case_folder(reader: Reader, data: bytes, parent: Path) -> Path:
    """Write one case into a fresh folder under ``parent``; returns the damaged file's path."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="hostile_", dir=parent))
    reader.setup(folder)
    path = folder / reader.filename
    path.write_bytes(data)
    return path
