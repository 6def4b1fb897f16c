"""``gc_paused``: hold Python's cyclic garbage collector off for a short, allocation-heavy section.

Planning a transition and applying one both create many small objects (lists, tuples, tensor
views) that stay alive until the section ends; the cyclic collector would walk them (and every
other live object of the process) again and again and free nothing. Reference counting still
frees everything as usual; the collector runs again when the section ends.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
