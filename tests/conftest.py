"""Suite-wide scheduling for ``make test``'s two pytest-xdist workers (``-n 2``).

Work is handed out one group at a time: each test file is a group, so a module's fixtures are built
once, as in a serial run, and every multi-process test (``tests/dist``: 2-4 torch.distributed ranks
each) is in ONE group, so they run one after another on one worker while the other worker runs the
single-process tests. On a 2-core machine two of them at once would put 4-8 ranks on 2 cores and
stretch their per-message waits. ``tests/dist`` comes first in collection order, so the longest
group starts first. Without xdist (plain ``pytest``) this hook is never called.

(xdist's own ``--dist loadgroup`` would do this with marks, but with pytest 9 its renaming of the
test ids has no effect, so the grouping is done here, in the scheduler.)
"""
from __future__ import annotations

import pytest

DIST = "tests/dist/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return DIST if path.startswith(DIST) else path

    return FileGroups(config, log)
