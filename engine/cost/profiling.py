"""torch.profiler around a few steps of anything, saved as a Chrome trace (chrome://tracing, Perfetto).

    from engine.cost.profiling import chrome_trace
    summary = chrome_trace(lambda i: eng.generate([prompt], 8, spec=spec), "trace.json", steps=3)
    summary.path, summary.top_ops[0].name, summary.top_ops[0].self_ms

The measured cost model's optional trace (DESIGN §2 "Cost models"): wall-clock phases say *where* a
forward spends its time, the trace says *which ops*. Each profiled step is wrapped in
`record_function(f"{label}{i}")`, so steps show up as named spans. CUDA activity is recorded when a GPU
is present; the ranking then uses device time, else CPU self time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass(frozen=True)
class OpRow:
    """One operator aggregated over the profiled steps; times in milliseconds."""

    name: str
    calls: int
    self_ms: float
    total_ms: float


@dataclass(frozen=True)
class TraceSummary:
    """Where the trace went and the most expensive operators (by self time, descending)."""

    path: str
    steps: int
    label: str
    device: str  # "cuda" when device time was recorded and ranked, else "cpu"
    top_ops: tuple[OpRow, ...]


def chrome_trace(
    step: Callable[[int], object],
    path: str | Path,
    steps: int = 3,
    warmup: int = 1,
    label: str = "step",
    top: int = 15,
    record_shapes: bool = False,
) -> TraceSummary:
    """Run `step(i)` `warmup` times unprofiled, then `steps` times under torch.profiler; write the trace.

    step: called with the step index (warm-up steps get negative indices). path: Chrome-trace JSON file
    (parent folders are created). Returns the `top` operators by self time.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    for i in range(-warmup, 0):
        step(i)
    use_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for i in range(steps):
            with record_function(f"{label}{i}"):
                step(i)
            if use_cuda:
                torch.cuda.synchronize()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    device = "cuda" if use_cuda else "cpu"
    rows = []
    for ev in prof.key_averages():
        if ev.key.startswith(label) and ev.key[len(label) :].isdigit():
            continue  # our own step spans: their self time is Python overhead, total time is everything
        self_us = getattr(ev, "self_device_time_total", 0.0) if use_cuda else ev.self_cpu_time_total
        total_us = getattr(ev, "device_time_total", 0.0) if use_cuda else ev.cpu_time_total
        rows.append(OpRow(ev.key, int(ev.count), self_us / 1e3, total_us / 1e3))
    rows.sort(key=lambda r: -r.self_ms)
    return TraceSummary(str(path), steps, label, device, tuple(rows[:top]))
