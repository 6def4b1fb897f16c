"""The GPU check's Hugging Face parts in their CPU smoke form (``benchmarks/gpu_device_check.py
--hf-bf16 / --model-timings --device cpu``; ``gpu_check.sh --cpu-smoke`` runs the same): the
bf16 forward check passes on the executor's own forward and fails when one weight is off; the
timings come out as corpus rows the corpus loader reads, labelled as a CPU smoke run."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_device_check", ROOT / "benchmarks" / "gpu_device_check.py")
gdc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gdc)


def test_the_bf16_forward_check_passes_on_the_executors_forward_and_fails_on_a_wrong_weight(monkeypatch):
    res = gdc.hf_bf16("cpu")
    assert res["passed"] and set(res["archs"]) == {"llama", "qwen2", "qwen3"}
    for arch, row in res["archs"].items():
        assert row["ran_in_bf16"] and row["params_bf16"] and row["state_on_device"], arch
        assert row["executor_vs_hf_fp32"] <= gdc.HF_BF16_SLACK * row["hf_bf16_vs_hf_fp32"] + 1e-3 * row["logits_scale"]
    # one norm weight of the store off by 5%: the check must say so
    import nereus.executor.hf.checkpoint as ckpt_mod

    real = ckpt_mod.load_regions

    def off_by_a_bit(store, *a, **kw):
        n = real(store, *a, **kw)
        for r, t in store.items():
            if r.kind == "param" and r.tensor.endswith("norm.weight"):
                t.mul_(1.05)
                break
        return n

    monkeypatch.setattr(ckpt_mod, "load_regions", off_by_a_bit)
    assert not gdc.hf_bf16("cpu")["passed"]


def test_model_timings_are_corpus_rows_labelled_as_a_cpu_smoke_run(tmp_path):
    from nereus.fidelity.corpus import load_corpus

    res = gdc.model_timings("cpu", quick=True)
    assert res["passed"] and res["hardware"] == "cpu"
    files = gdc.write_corpus_rows(res["rows"], str(tmp_path))
    assert sorted(pathlib.Path(f).name for f in files) == ["decode.csv", "prefill.csv", "training.csv"]
    rows = load_corpus(tmp_path)  # the corpus loader's own checks: header, values > 0, ids unique
    batches = {str(b) for b in gdc.QUICK_SHAPES["batches"]}
    by = {c: [r for r in rows if r.category == c] for c in ("prefill", "decode", "training")}
    assert {r.get("batch") for r in by["prefill"]} == batches == {r.get("batch") for r in by["decode"]}
    assert {r.get("micro_batch") for r in by["training"]} == {str(b) for b in gdc.QUICK_SHAPES["train_batches"]}
    assert {r.metric for r in by["prefill"]} == {"ttft_ms"} and {r.metric for r in by["decode"]} == {"tpot_ms"}
    assert {r.metric for r in by["training"]} == {"tok_s_per_gpu"}
    for r in rows:
        assert r.split == "heldout" and r.gpus == 0 and r.hardware == "cpu"
        assert "this check" in r.source and r.notes.startswith("CPU smoke run")
        assert r.get("dtype") == "bf16"


def test_gpu_names_map_to_the_corpus_hardware_names():
    assert gdc._hardware("NVIDIA H200") == "h200"
    assert gdc._hardware("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert gdc._hardware("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"


def test_asking_for_cuda_without_it_is_one_line_and_exit_2(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gdc.main(["--hf-bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs CUDA" in err and "--device cpu" in err


@pytest.mark.slow
def test_the_cpu_smoke_run_of_gpu_check_runs_every_cpu_form_and_says_it_is_not_a_gpu_result(tmp_path):
    import json
    import subprocess

    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke", str(tmp_path)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cpu_smoke"] and "not a GPU result" in summary["note"] and summary["failed"] == 0
    assert [s["step"] for s in summary["steps"]] == ["hash_speed_cpu", "hf_bf16_cpu", "model_timings_cpu"]
    assert json.loads((tmp_path / "hf_bf16_cpu.json").read_text())["passed"]
    assert (tmp_path / "corpus" / "decode.csv").exists()
