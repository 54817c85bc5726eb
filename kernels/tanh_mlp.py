"""A frozen policy's tanh-MLP actor in C++ (`tanh_mlp.cpp`); its reference twin is the numpy actor of
`engine.runtime.frozen` (same logits to ~1e-15, same decisions: tested).

    from kernels import tanh_mlp
    actor = tanh_mlp.actor(lo, hi, [(W0, b0), ..., (W_out, b_out)], dims)   # None when the extension is off
    actor.act(values)       # observation values [OBS_DIM] (a list of floats) -> (index per action dimension)

Why: between two engine rounds every numpy call starts with cold caches, and the numpy actor's dozen calls cost
~80 µs there (README, issue 10 item 3) against ~14 µs in a warm loop; one call into this extension replaces them.
Built on first use (plain C++, no CPU-specific flags, a few seconds once); off when `EXPERTSPEC_NATIVE_ACTOR=0`,
without a compiler, or on a failed build (`status()` says which), and the numpy twin then acts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.cpp_build import CppExtension

_EXT = CppExtension("tanh_mlp", "EXPERTSPEC_NATIVE_ACTOR")
load = _EXT.load  # the compiled extension (built on the first call), or None when it is off
status = _EXT.status  # 'on' or 'off (<why>)'


def actor(lo: np.ndarray, hi: np.ndarray, layers: Sequence[tuple[np.ndarray, np.ndarray]], dims: int) -> Any:
    """The C++ actor: clip to [lo, hi] [in], tanh after every layer but the last (W [out, in], b [out]), the last
    layer's rows padded to dims × width; None when the extension is off."""
    module = load()
    if module is None:
        return None
    ws = [np.ascontiguousarray(w, dtype=np.float64).ravel().tolist() for w, _ in layers]
    bs = [np.asarray(b, dtype=np.float64).tolist() for _, b in layers]
    return module.TanhMLP(np.asarray(lo, np.float64).tolist(), np.asarray(hi, np.float64).tolist(), ws, bs, dims)
