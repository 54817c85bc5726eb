"""The environments' action spaces over the shared grid `engine.runtime.action_grid.ActionGrid`.

    MultiDiscrete(grid.nvec)   a = (K index, W index, λ index, rule index)  -> grid.spec(a) : SpecConfig
    Box([-1, 1]^4)             x_i -> index floor((x_i + 1) / 2 · n_i), clipped to n_i - 1

The grid is the one the learned policies are frozen with (ctrl.freeze, engine.runtime.frozen), so an
index means the same thing in both environments, in training and in the deployed engine. K, W, λ are
chosen before drafting; the rule (("all", 0) or ("threshold", p)) reads this round's draft. An action
outside the space raises ValueError naming the space.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

from engine.runtime.action_grid import ActionGrid

ACTION_KINDS = ("multidiscrete", "box")


def as_grid(grid: ActionGrid | dict | None) -> ActionGrid:
    """An ActionGrid from itself, its `to_dict()` / field dict, or None (the default grid)."""
    if grid is None:
        return ActionGrid()
    if isinstance(grid, ActionGrid):
        return grid
    if isinstance(grid, Mapping):
        known = {"depths", "widths", "lams", "rules", "frontier"}
        unknown = sorted(set(grid) - known)
        if unknown:
            raise ValueError(f"unknown grid fields {unknown}; ActionGrid has {sorted(known)}")
        d = ActionGrid().to_dict() | dict(grid)
        return ActionGrid.from_dict(d)
    raise TypeError(f"grid must be an ActionGrid, a dict of its fields or None, got {type(grid).__name__}")


class ActionCodec:
    """Decodes env actions of one kind into grid indices (and flat indices for table lookups)."""

    def __init__(self, grid: ActionGrid, kind: str = "multidiscrete") -> None:
        if kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {kind!r}; use one of {ACTION_KINDS}")
        self.grid, self.kind = grid, kind
        self.nvec = [int(n) for n in grid.nvec]
        self._nvec_np = np.asarray(self.nvec, dtype=np.int64)
        self.num_actions = int(np.prod(self.nvec))

    @property
    def space(self) -> spaces.Space:
        if self.kind == "multidiscrete":
            return spaces.MultiDiscrete(self.nvec)
        return spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)

    def flat(self, idx: tuple[int, int, int, int]) -> int:
        _, nW, nL, nR = self.nvec
        k, w, l, r = idx
        return ((k * nW + w) * nL + l) * nR + r

    def unflat(self, a: int) -> tuple[int, int, int, int]:
        _, nW, nL, nR = self.nvec
        a, r = divmod(int(a), nR)
        a, l = divmod(a, nL)
        k, w = divmod(a, nW)
        return k, w, l, r

    def decode(self, action: Any) -> tuple[int, int, int, int]:
        """An action of this space -> grid indices; ValueError when it lies outside the space."""
        if self.kind == "multidiscrete":
            if type(action) is np.ndarray and action.dtype.kind in "iu" and action.shape == (4,):
                k, w, l, r = action.tolist()  # fast path: what MultiDiscrete.sample() and SB3 hand in
                n = self.nvec
                if 0 <= k < n[0] and 0 <= w < n[1] and 0 <= l < n[2] and 0 <= r < n[3]:
                    return k, w, l, r
            try:
                x = np.asarray(action)
            except Exception as err:  # noqa: BLE001 - anything array-like is accepted, the rest refused
                raise ValueError(f"action {action!r} is not array-like") from err
            if x.shape != (4,) or not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
                raise ValueError(
                    f"action {action!r} must be 4 integers (K, W, λ, rule indices) in MultiDiscrete({self.nvec})"
                )
            return self.grid.check(x.tolist())
        try:
            x = np.asarray(action, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"action {action!r} must be 4 finite numbers in Box([-1, 1]^4)") from err
        if x.shape != (4,) or not np.all(np.isfinite(x)):
            raise ValueError(f"action {action!r} must be 4 finite numbers in Box([-1, 1]^4)")
        if np.any(x < -1.0 - 1e-6) or np.any(x > 1.0 + 1e-6):
            raise ValueError(f"action {action!r} lies outside Box([-1, 1]^4)")
        idx = np.minimum(np.floor((np.clip(x, -1.0, 1.0) + 1.0) / 2.0 * self._nvec_np), self._nvec_np - 1)
        return tuple(int(v) for v in idx)  # type: ignore[return-value]

    def encode(self, idx: tuple[int, int, int, int] | list[int]) -> np.ndarray:
        """Grid indices -> an action of this space (the Box centre of each cell)."""
        i = np.asarray(idx, dtype=np.int64)
        if self.kind == "multidiscrete":
            return i
        return ((i + 0.5) / self._nvec_np * 2.0 - 1.0).astype(np.float32)
