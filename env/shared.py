"""Process-wide sharing of what replay environments derive from the same tables.

Every `expertspec/Replay-v0` over one trace, grid and cost model reads the same `ReplayTables`, and at step time
indexes Python-list views of them (a list index costs ~20 ns where a numpy scalar costs ~100). For a 500-prompt
trace (32,000 positions, ~1.1 M outcomes) one env's views are ~1.6 GB of Python objects and take ~14 s to build,
and a training run holds a dozen envs (n_envs per seed, the held-out evaluation's, the baselines'): a 500-prompt
evaluation ran out of 24 GB. So the tables are loaded once per process (env.tables.load_or_build_tables) and
each view is built once per array object (`view`), shared by every env over it and dropped with the array.
Environments only read them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

_VIEWS: dict[tuple[str, int], tuple[weakref.ref, Any]] = {}


def view(tag: str, arr: np.ndarray, make: Callable[[np.ndarray], T]) -> T:
    """`make(arr)`, built once per (tag, array object) in this process and shared until the array is freed.

    `tag` names what is derived (one array can have several views); `make` must depend on `arr` (and on what
    is fixed with it, such as the other arrays of its tables) only, and its result must not hold `arr` (the
    entry would then keep it alive for the process's lifetime)."""
    key = (tag, id(arr))
    hit = _VIEWS.get(key)
    if hit is not None and hit[0]() is arr:
        return hit[1]
    out = make(arr)
    # the entry goes with the array: its id can be reused only after this callback has run
    _VIEWS[key] = (weakref.ref(arr, lambda _ref, key=key: _VIEWS.pop(key, None)), out)
    return out


def live_views() -> int:
    """How many views this process holds (tests)."""
    return len(_VIEWS)
