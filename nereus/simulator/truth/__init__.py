"""The simulator's ground truth (SIMULATED): a request- and micro-batch-level model of the machine
built from published measurements. It shares no code with the planner's cost model (see README.md
and tests/unit/test_truth_imports.py)."""
