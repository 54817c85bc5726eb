"""Per-phase wall-clock timing for the measured cost model.

A `PhaseTimer` is threaded through a forward pass; each phase (`attention`, `router`, `experts`,
`combine`, `mlp`, ...) adds its elapsed seconds. On CUDA the device is synchronised at phase
boundaries so the numbers are device time, not launch time. With no timer, nothing is measured and
nothing is synchronised.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


class PhaseTimer:
    """Accumulates seconds per named phase. `sync=True` synchronises CUDA around each phase."""

    def __init__(self, sync: bool | None = None) -> None:
        self.sync = torch.cuda.is_available() if sync is None else sync
        self.seconds: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.seconds[name] += self._now() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def reset(self) -> dict[str, float]:
        """Return the accumulated seconds and start again from zero."""
        out = dict(self.seconds)
        self.seconds = defaultdict(float)
        return out


_NULL = nullcontext()


def maybe_phase(timer: PhaseTimer | None, name: str):
    """`timer.phase(name)` when a timer is given, else a shared no-op context."""
    return _NULL if timer is None else timer.phase(name)
