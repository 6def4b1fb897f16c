"""Calibration: microbenchmarks, fitting, profiles."""
