"""The DCP comparison benchmark runs end to end on a tiny state: all three methods, bit-exact; on a
Hugging Face Llama in bf16 with fp32 master and moments, the arena reserved at start."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reshard_vs_dcp_benchmark_smoke(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reshard_vs_dcp.py"), "--layers", "1",
                           "--hidden", "64", "--arch", "llama", "--precision", "bf16-mixed", "--repeat", "1",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    for key in ("state_bytes", "nereus_s", "dcp_s", "raw_p2p_s", "speedup_vs_dcp", "fraction_of_raw"):
        assert key in r
    assert r["nereus_bit_exact"] and r["dcp_bit_exact"]
    assert r["speedup_vs_dcp"] == r["dcp_s"] / r["nereus_s"] and r["fraction_of_raw"] == r["raw_p2p_s"] / r["nereus_s"]
    assert r["exchanges"] >= 1 and r["network_bytes"] > 0
    assert r["floor_s"] > 0 and r["floor_fraction_of_raw"] == r["raw_p2p_s"] / r["floor_s"]
    assert r["floor_messages_s"] > 0 and r["floor_messages_fraction_of_raw"] == r["raw_p2p_s"] / r["floor_messages_s"]
    assert 0 < r["data_messages"] < r["messages"]  # the transition's own messages; the rest carry checksums
    assert r["precision"] == "bf16-mixed" and r["model"].startswith("llama") and len(r["shapes"]) == 1
    assert r["arena_reserved_at_start"] and r["nereus_first_s"] > 0
    assert set(r["targets_met"]) == {"speedup_vs_dcp", "nereus_over_floor", "first_over_warm"}
    assert r["nereus_over_floor"] == r["nereus_s"] / r["floor_s"]
