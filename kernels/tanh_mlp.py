"""A frozen policy's choice in C++ (`tanh_mlp.cpp`): its tanh-MLP actor, and the observation values read straight from
a request's History. Reference twins: the numpy actor of `engine.runtime.frozen` (same logits to ~1e-15, same
decisions) and `engine.runtime.observation.observation_values` (the same values bit for bit): tested.

    from kernels import tanh_mlp
    actor = tanh_mlp.actor(lo, hi, [(W0, b0), ..., (W_out, b_out)], dims)   # None when the extension is off
    actor.act(values)       # observation values [OBS_DIM] (a list of floats) -> (index per action dimension)
    actor.logits(values)    # padded logits [dims * width]
    actor.observe(KMAX, calibration)   # the observation layout, the policy's isotonic calibration (or None)
    actor.choose(history, position, max_new_tokens, batch_size, top_k, num_moe_layers)   # -> indices, one call
    actor.set_actions(nvec, make)      # the action table: make(indices) -> action, called once per action
    actor.choose_action(history, ...)  # -> the table's action: what a session's round takes, in one call
    actor.set_plain(indices)           # plain decoding's indices, answered at once when the probe proposes nothing
    actor.values(history, ...)         # the observation values `choose` computes (its reference check)

Why: between two engine rounds every first call starts with cold caches (README, issue 10 item 3): the numpy actor's
dozen calls cost ~80 µs there, the observation values in Python ~30 µs, a pybind11 call that does nothing ~12 µs;
`act` and `choose` are raw CPython calls (~6 µs empty) on a capsule of the actor, bound with functools.partial.
Built on first use (plain C++, no CPU-specific flags: an AVX2 clone of the layers where GCC builds one, chosen at
load time, with the same logits bit for bit; a few seconds once); off when `EXPERTSPEC_NATIVE_ACTOR=0`,
without a compiler, or on a failed build (`status()` says which), and the numpy and Python twins then run.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from kernels.cpp_build import CppExtension

_EXT = CppExtension("tanh_mlp", "EXPERTSPEC_NATIVE_ACTOR", cflags=("-O3", "-ffp-contract=off", "-fno-trapping-math"))
load = _EXT.load  # the compiled extension (built on the first call), or None when it is off
status = _EXT.status  # 'on' or 'off (<why>)'


class Actor:
    """The C++ actor: `act`, `logits`, and after `observe`, `choose` / `values` on a History (module docstring)."""

    def __init__(self, module: Any, mlp: Any) -> None:
        self._mlp = mlp  # owns the C++ object the capsule points at
        cap = mlp.capsule()
        self.act = partial(module.act, cap)
        self.choose = partial(module.choose, cap)
        self.choose_action = partial(module.choose_action, cap)
        self.values = partial(module.values, cap)
        self.logits = partial(module.logits, cap)

    def set_actions(self, nvec: Sequence[int], make: Any) -> None:
        """The table `choose_action` answers from: the real size of each action dimension, and `make(indices) ->
        action`, called the first time each action is chosen (its result kept). `make` must not hold this actor (the
        C++ object is not garbage-collected: a cycle through it would never be freed)."""
        self._mlp.set_actions([int(n) for n in nvec], make)

    def set_plain(self, indices: Sequence[int] | None) -> None:
        """Plain decoding's action indices, which `choose` and `choose_action` answer without the observation or the
        actor when their probe proposes nothing (its first kmax values all 0: the drafter's own probe found nothing to
        draft); None turns it off (the default)."""
        self._mlp.set_plain([int(i) for i in indices] if indices is not None else [])

    def observe(self, kmax: int, calibration: Any = None) -> None:
        """Set the observation layout `choose` computes: `kmax` draft depths, and the calibrated block from
        `calibration` (an `engine.spec.calibration.IsotonicCalibration`, or None: the raw confidences)."""
        kx = [list(map(float, k)) for k in calibration.knots_x] if calibration is not None else []
        ky = [list(map(float, k)) for k in calibration.knots_y] if calibration is not None else []
        if calibration is not None and not kx:
            raise ValueError("tanh_mlp: a calibration with no depths")
        self._mlp.set_observation(kmax, kx, ky)


def actor(lo: np.ndarray, hi: np.ndarray, layers: Sequence[tuple[np.ndarray, np.ndarray]], dims: int) -> Actor | None:
    """The C++ actor: clip to [lo, hi] [in], tanh after every layer but the last (W [out, in], b [out]), the last
    layer's rows padded to dims × width; None when the extension is off."""
    module = load()
    if module is None:
        return None
    ws = [np.ascontiguousarray(w, dtype=np.float64).ravel().tolist() for w, _ in layers]
    bs = [np.asarray(b, dtype=np.float64).tolist() for _, b in layers]
    mlp = module.TanhMLP(np.asarray(lo, np.float64).tolist(), np.asarray(hi, np.float64).tolist(), ws, bs, dims)
    return Actor(module, mlp)
