"""Write nereus/data/traces/ramp_1024_noisy.csv: the shipped ramp_1024 trace as a job logs it (per
step the mean and longest of 1,024 sampled responses, the cap in its own column), so every step
differs. SIMULATED lengths (``nereus.simulator.trace.as_logged``), seed 0.

    .venv/bin/python benchmarks/make_noisy_trace.py
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.simulator.trace import TRACE_DIR, as_logged, load_trace  # noqa: E402


def main() -> int:
    base = load_trace("ramp_1024")
    noisy = as_logged(base, prompts=256, samples=4, seed=0, name="ramp_1024_noisy")
    head = ("SIMULATED per-step noise on ramp_1024 (benchmarks/make_noisy_trace.py): each step's mean and longest "
            "response are those of 256 x 4 responses sampled from that step's distribution; the cap is "
            "response_len_cap.\n" + base.source)
    from dataclasses import replace

    text = replace(noisy, source=head).to_csv()
    (TRACE_DIR / "ramp_1024_noisy.csv").write_text(text)
    print(f"wrote {TRACE_DIR / 'ramp_1024_noisy.csv'} ({len(noisy)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
