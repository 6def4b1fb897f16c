"""The parts of ``nereus.executor.apply``: pieces, exchanges, checksums, faults, the vote."""
