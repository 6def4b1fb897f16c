"""The spawn harness: a raising rank is reported with its traceback; a rank that never returns
is killed at the deadline and reported; the test ends in bounded time."""
import time

import pytest

from nereus.executor.launch import RankFailed, launch

pytestmark = pytest.mark.dist


def _raise_on_1(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _hang_on_1(rank, world):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed") as e:
        launch(_raise_on_1, 2, timeout_s=60)
    assert "ValueError: boom on purpose" in str(e.value) and "_raise_on_1" in str(e.value)


def test_hung_rank_is_killed_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] of 2 did not finish within 15 s"):
        launch(_hang_on_1, 2, timeout_s=15)
    assert time.monotonic() - t0 < 40


def test_the_failure_reported_is_the_rank_that_broke_not_a_peer_that_lost_it():
    """A rank that died takes the others' connections with it: their errors say so, and the report
    names the rank whose error was its own, whatever its number."""
    from nereus.executor.launch import _results

    got = {0: ("error", "RuntimeError: [gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:4"),
           1: ("ok", b""), 2: ("error", "TypeError: 'NoneType' object is not subscriptable"),
           3: ("error", "RuntimeError: Connection reset by peer")}
    with pytest.raises(RankFailed, match=r"rank 2 of 4 failed \(3 rank\(s\) failed") as e:
        _results(got, 4, [], False, "")
    assert "NoneType" in str(e.value)
    only_peers = {0: ("error", "Connection closed by peer"), 1: ("error", "Connection closed by peer")}
    with pytest.raises(RankFailed, match="rank 0 of 2 failed"):
        _results(only_peers, 2, [], False, "")


def _pid_and_sum(rank, world, x):
    import os

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + x)])
    dist.all_reduce(t)  # the group joined once is still up for the next call
    return os.getpid(), float(t[0])


def test_kept_ranks_run_every_call_on_the_same_processes_and_start_afresh_after_a_failure():
    from nereus.executor.launch import Ranks

    with Ranks(2) as ranks:
        first = ranks.run(_pid_and_sum, 1, timeout_s=60)
        second = ranks.run(_pid_and_sum, 10, timeout_s=60)
        assert [s for _, s in first] == [3.0, 3.0] and [s for _, s in second] == [21.0, 21.0]
        assert [p for p, _ in first] == [p for p, _ in second]  # no respawn between calls
        with pytest.raises(RankFailed, match=r"rank 1 of 2 failed") as e:
            ranks.run(_raise_on_1, timeout_s=60)
        assert "ValueError: boom on purpose" in str(e.value)
        third = ranks.run(_pid_and_sum, 0, timeout_s=60)  # fresh ranks after the failure
        assert [s for _, s in third] == [1.0, 1.0] and not {p for p, _ in third} & {p for p, _ in first}
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] of 2 did not finish within 10 s"):
            ranks.run(_hang_on_1, timeout_s=10)
        assert time.monotonic() - t0 < 30
