"""reshard-check's verdict and its input errors, without processes: a case passes only when the
logits in B were compared somewhere (before the fix, no comparison at all counted as a pass); a
killed rank is skipped, not its survivors; bad options are one line and exit 2."""
import pytest

from nereus.cli import main
from nereus.commands.reshard_check import FAULTS, _verdict
from nereus.executor.apply import FAULT_KINDS


def _ok(rank, compared=True, diff=1e-7):
    return {"rank": rank, "rolled_back": False, "mismatches": [], "compared_logits": compared,
            "logits_max_diff": diff if compared else 0.0, "logits_scale": 3.0 if compared else 0.0}


def test_a_case_where_no_rank_compared_logits_fails():
    ok, why = _verdict([_ok(0, compared=False), _ok(1, compared=False)], fault=False)
    assert not ok and "not compared" in why
    ok, why = _verdict([_ok(0, compared=False), _ok(1)], fault=False)
    assert ok and "logits max diff" in why
    ok, why = _verdict([_ok(0), _ok(1, diff=1e-3)], fault=False)
    assert not ok


def test_with_a_fault_every_survivor_must_roll_back_intact():
    back = {"rolled_back": True, "checksums_equal": True}
    assert _verdict([back, back, {"killed": True}], fault=True) == (True, "every surviving rank rolled back, "
                                                                          "checksums identical")
    assert not _verdict([back, {**back, "checksums_equal": False}], fault=True)[0]
    assert not _verdict([back, {"rolled_back": False}], fault=True)[0]  # a rank that hung or committed
    assert not _verdict([{"killed": True}], fault=True)[0]
    assert set(FAULTS.values()) <= set(FAULT_KINDS)


def _exit_code(argv) -> int:
    try:
        return main(["reshard-check", *argv])
    except SystemExit as e:  # argparse's own usage errors
        return e.code


@pytest.mark.parametrize("argv,needle", [
    (["--inject-fault", "melt"], "invalid choice"),
    (["--backend", "nccl"], "CUDA"),
    (["--backend", "nccl", "--world", "1"], "--world"),
])
def test_bad_options_are_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err.splitlines()[-1] and "Traceback" not in err


def _torchrun_env(monkeypatch, world=2):
    for k, v in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)


def test_kill_under_torchrun_is_refused(capsys, monkeypatch):
    _torchrun_env(monkeypatch)
    assert main(["reshard-check", "--world", "2", "--inject-fault", "kill"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "torchrun" in err and "kill" in err


def test_torchrun_with_another_world_is_a_one_line_error(capsys, monkeypatch):
    _torchrun_env(monkeypatch, world=2)
    assert main(["reshard-check", "--world", "3", "--cases", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "WORLD_SIZE" in err and "--world 2" in err
