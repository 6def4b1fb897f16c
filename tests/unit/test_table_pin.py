"""The option tables' speed work changes no option: the tables of the cheap problems of
``benchmarks/table_pin.py`` (dense and MoE, sync and async schedules, context parallelism, offload,
ZeRO-3 frozen models, calibrated stage factors, colocated and pinned-layout constraints), built cold,
equal the fingerprints the code gave before that work (commit 04f4914, ``tests/data/table_pin.json``)
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
