"""``nereus demo``'s schedule: the sync demo runs DemoConfig's (three steps at each cap, sized for
``make demo``'s time), ``--schedule one_step_off`` its own (setup.ONE_STEP_OFF_DEFAULTS), and
``--steps`` overrides either."""
import nereus.demo.async_run as async_run
import nereus.demo.run as demo_run
from nereus.cli import main
from nereus.demo.setup import ONE_STEP_OFF_DEFAULTS, DemoConfig, cap_at


def _cfg_of(argv, monkeypatch):
    got = {}
    monkeypatch.setattr(demo_run, "run_demo", lambda cfg, budgets=None: got.setdefault("cfg", cfg) and None)
    monkeypatch.setattr(async_run, "run_async_demo", lambda cfg: got.setdefault("cfg", cfg) and None)
    assert main(["demo", *argv]) == 0
    return got["cfg"]


def test_the_sync_demo_runs_three_steps_at_each_cap_and_one_step_off_its_own_schedule(monkeypatch):
    sync = _cfg_of([], monkeypatch)
    assert sync.steps == DemoConfig().steps == 9 and sync.cap_schedule == ((0, 32), (3, 64), (6, 128))
    assert [cap_at(sync, s) for s in range(sync.steps)] == [32] * 3 + [64] * 3 + [128] * 3
    off = _cfg_of(["--schedule", "one_step_off"], monkeypatch)
    assert (off.steps, off.cap_schedule, off.warmup_steps) == (24, ONE_STEP_OFF_DEFAULTS["cap_schedule"], 8)
    assert _cfg_of(["--schedule", "one_step_off", "--steps", "5"], monkeypatch).steps == 5
    assert _cfg_of(["--steps", "4", "--repeats", "3"], monkeypatch).repeats == 3
