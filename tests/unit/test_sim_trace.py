import pytest

from nereus.errors import SpecError
from nereus.simulator.trace import load_trace, parse_trace
from nereus.planner.specs import Workload

CSV = """# source: test
step,response_len_mean,response_len_max,gpus
0,1000,4096,8
3,2000,8192,16
5,2500,8192,16
"""


def test_sparse_rows_hold_until_next_row():
    t = parse_trace(CSV)
    assert [r.step for r in t.rows] == [0, 1, 2, 3, 4, 5]
    assert [r.response_len_mean for r in t.rows] == [1000, 1000, 1000, 2000, 2000, 2500]
    assert [r.gpus for r in t.rows] == [8, 8, 8, 16, 16, 16]
    assert t.source == "source: test"
    w = t.workload(3, Workload(sequences=64, prompt_len=512, response_len_mean=100, response_len_max=200))
    assert (w.response_len_mean, w.response_len_max, w.prompt_len, w.sequences) == (2000, 8192, 512, 64)


def test_round_trip_through_csv():
    t = parse_trace(CSV)
    assert parse_trace(t.to_csv()).rows == t.rows


@pytest.mark.parametrize("text,msg", [
    ("step,response_len_mean,gpus\n0,1,8\n", "missing column"),
    ("step,response_len_mean,response_len_max,gpus\n0,1000,4096,8\n0,1000,4096,8\n", "does not follow"),
    ("step,response_len_mean,response_len_max,gpus\n0,5000,4096,8\n", "response_len_mean(5000.0) > response_len_max(4096)"),
    ("step,response_len_mean,response_len_max,gpus,foo\n0,1,2,8,1\n", "unknown column"),
    ("step,response_len_mean,response_len_max,gpus\n0,abc,4096,8\n", "must be a number"),
])
def test_bad_traces_name_the_problem(text, msg):
    with pytest.raises(SpecError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse_trace(text)


def test_shipped_traces():
    ramp = load_trace("ramp_1024")
    assert len(ramp) == 1000 and ramp.max_gpus == 1024 and ramp.rows[0].gpus == 128
    ds = load_trace("deepscaler_staged")
    caps = sorted({r.response_len_max for r in ds.rows})
    assert caps == [8192, 16384, 24576] and {r.gpus for r in ds.rows} == {8, 32}
    r1 = load_trace("r1zero_linear")
    assert r1.rows[-1].response_len_mean > 5 * r1.rows[0].response_len_mean
    for t in (ramp, ds, r1):
        assert "Source" in t.source or "Sources" in t.source
