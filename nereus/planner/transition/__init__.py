"""Transitions between plans: EMUs and holdings (``emu``), region maths (``regions``), the data
the executor applies (``types``), pieces and source choice (``pieces``), the transfer schedule
(``schedule``), assembly and the transition graph (``graph``), and the entry points
``build.plan_transition`` / ``build.transition_cost``. See README.md. Torch- and solver-free at
import (CP-SAT is imported only when the CP-SAT scheduler runs), so the executor may use it."""
