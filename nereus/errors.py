"""Typed errors. Every message names the problem and the numbers behind it."""


class NereusError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


class SpecError(NereusError, ValueError):
    """A job, cluster, model, workload or plan specification is invalid."""


class InfeasibleError(NereusError):
    """No memory-feasible plan exists; the message names the binding constraint."""

    def __init__(self, message: str, *, binding: str | None = None, need_bytes: float | None = None,
                 have_bytes: float | None = None) -> None:
        super().__init__(message)
        self.binding = binding
        self.need_bytes = need_bytes
        self.have_bytes = have_bytes


class TransitionError(NereusError):
    """A transition could not be planned or applied (rolled back)."""
