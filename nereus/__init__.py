"""Nereus."""
