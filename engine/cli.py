"""Shared set-up of the Hydra entry points (demo, bench, ep_run).

They run where they are started, write no Hydra output folder and keep Hydra's own logging quiet, unless
the command line says otherwise (any `hydra.run.dir=...` override turns these defaults off).
"""

from __future__ import annotations

import sys

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
        sys.argv += list(QUIET_HYDRA)
