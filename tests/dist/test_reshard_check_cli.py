"""`nereus reshard-check` end to end on 2 gloo processes, and its one-line error."""
import json

import pytest

from nereus.cli import main

pytestmark = pytest.mark.dist


def test_reshard_check_passes_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rc.json"
    assert main(["reshard-check", "--world", "2", "--cases", "2", "--seed", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"cases", "passed", "failed", "bytes_moved", "seconds"}
    assert data["cases"] == data["passed"] == 2 and data["failed"] == 0 and data["bytes_moved"] > 0
    assert "2 passed, 0 failed" in capsys.readouterr().out


def test_reshard_check_bad_world_is_one_line_error(capsys):
    assert main(["reshard-check", "--world", "1", "--cases", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--world" in err and "got 1" in err


def test_reshard_check_on_a_hf_architecture_in_mixed_precision(tmp_path, capsys):
    """Qwen3 (q/k norms) with bf16 params and fp32 master and moments: same JSON and exit code."""
    out = tmp_path / "rc.json"
    assert main(["reshard-check", "--world", "2", "--cases", "2", "--seed", "4", "--arch", "qwen3",
                 "--precision", "bf16-mixed", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"cases", "passed", "failed", "bytes_moved", "seconds"}
    assert data["cases"] == data["passed"] == 2 and data["failed"] == 0
    text = capsys.readouterr().out
    assert "2 passed, 0 failed" in text and "bits ok" in text and "tolerance" in text


def test_reshard_check_injects_a_corrupted_byte_and_every_rank_rolls_back(tmp_path, capsys):
    """``--inject-fault corrupt``: a bit flipped in a message a receiving rank gets; the case
    passes when every rank rolled back to its old checksums (same JSON, exit 0)."""
    out = tmp_path / "rc.json"
    assert main(["reshard-check", "--world", "2", "--cases", "1", "--seed", "5", "--inject-fault", "corrupt",
                 "--timeout", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"cases", "passed", "failed", "bytes_moved", "seconds"}
    assert data["cases"] == data["passed"] == 1 and data["failed"] == 0
    text = capsys.readouterr().out
    assert "fault corrupt on rank" in text and "all ranks rolled back, checksums identical" in text
