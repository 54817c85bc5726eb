"""Shared set-up of the Hydra entry points (demo, bench, ep_run, zoo, kernels.bench).

They run where they are started, write no Hydra output folder and keep Hydra's own logging quiet, unless
the command line says otherwise (any `hydra.run.dir=...` override turns these defaults off). Progress bars
are the entry points' too: `step_bars` turns a training loop's `on_step` reports into tqdm bars.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm

QUIET_HYDRA = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
               "hydra/hydra_logging=disabled")  # fmt: skip


def quiet_hydra_argv(modes: tuple[str, ...] = ()) -> None:
    """Rewrite sys.argv in place: a leading positional mode (one of `modes`) becomes `mode=<it>`, and the
    quiet Hydra defaults are appended when the user set no run directory."""
    if modes and len(sys.argv) > 1 and sys.argv[1] in modes:
        sys.argv[1] = f"mode={sys.argv[1]}"
    elif modes and len(sys.argv) > 1 and not sys.argv[1].startswith(("-", "+", "~")) and "=" not in sys.argv[1]:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}; choose from {', '.join(modes)}")
    if not any(a.startswith("hydra.run.dir") for a in sys.argv):
        sys.argv[1:1] = QUIET_HYDRA  # first: overrides after a flag (--cfg job, --help) would not parse


def step_bars() -> Callable[[str, int, int, dict[str, float]], None]:
    """An `on_step(desc, step, steps, metrics)` callback (`engine.zoo.train_lm.train_loop`) that draws one
    tqdm bar per stage, opened at its first step and closed at its last, metrics in the postfix."""
    bars: dict[str, tqdm] = {}

    def on_step(desc: str, step: int, steps: int, metrics: dict[str, float]) -> None:
        bar = bars.get(desc)
        if bar is None:
            bar = bars[desc] = tqdm(total=steps, desc=desc, dynamic_ncols=True)
        bar.update(1)
        if step % 10 == 1 or step == steps:
            bar.set_postfix({k: f"{v:.0f}" if k.endswith("/s") else f"{v:.3f}" for k, v in metrics.items()})
        if step >= steps:
            bars.pop(desc).close()

    return on_step
