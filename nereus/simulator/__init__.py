"""Trace-driven simulator (all results SIMULATED): traces, the ground-truth model, the policies
and the offline oracle. It uses the planner; the planner never imports it. See README.md."""
