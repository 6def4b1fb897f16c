"""The option tables' speed work changes no option: the tables of the cheap problems of
``benchmarks/table_pin.py`` (dense and MoE, sync and async schedules, context parallelism, offload,
ZeRO-3 frozen models, calibrated stage factors, colocated and pinned-layout constraints), built cold,
equal the fingerprints the code gave before that work (commit 04f4914, ``tests/data/table_pin.json``;
re-pinned when the cross-pool weight sync gained its per-tensor terms: only the non-colocated syncs moved;
and the two ``:wide`` problems when offloaded optimizer state came back for the optimizer step: only
offload rows moved)
to 12 significant digits. ``benchmarks/table_pin.py --check`` compares the 1,024-GPU ones too."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from table_pin import CHEAP, PIN, PROBLEMS, diff, fingerprint

PINNED = json.loads(PIN.read_text())


@pytest.mark.parametrize("name", CHEAP)
def test_option_tables_equal_the_pin(name):
    assert diff(name, fingerprint(PROBLEMS[name]()), PINNED[name]) == []


def test_the_pin_covers_every_problem():
    assert set(PINNED) == set(PROBLEMS) and set(CHEAP) <= set(PROBLEMS)


def test_all_pairs_dominance_equals_the_sequential_scan():
    """``_undominated`` (all pairs at once) keeps exactly what the scan over the sorted rows keeps,
    exact ties and rows equal on some axes included."""
    import numpy as np

    from nereus.planner.solver.candidates import _undominated, _undominated_loop

    rng = np.random.default_rng(0)
    for n, width in ((1, 3), (2, 2), (40, 3), (200, 5), (300, 19)):
        for levels in (3, 50):
            rows = [tuple(float(x) for x in r) for r in rng.integers(0, levels, (n, width))]
            assert _undominated(rows) == _undominated_loop(rows)
