"""What a benchmark's JSON records about the machine it ran on (timings move with it): the CPU model
and core count as /proc/cpuinfo and os report them, the load average when asked, the git commit."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine_info() -> dict:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu_model": model, "cpus": os.cpu_count(), "load_average_1_5_15": list(os.getloadavg()),
            "python": platform.python_version(), "commit": commit}
