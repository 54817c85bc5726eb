"""Calibrated draft confidence as plain data: (raw confidence, depth) -> P(accepted | parent accepted).

The map is plain data below the runtime, so the engine, a frozen policy and both environments
apply the same one; it is fitted on recorded traces by `env.calibration.fit_calibration` (isotonic per depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class IsotonicCalibration:
    """Callable (raw confidence, depth 1..) -> P(accepted); plain data, picklable and JSON-able."""

    knots_x: tuple[tuple[float, ...], ...]  # [D] per depth
    knots_y: tuple[tuple[float, ...], ...]

    def __call__(self, confidence: float, depth: int) -> float:
        d = min(max(int(depth), 1), len(self.knots_x)) - 1
        if not self.knots_x[d]:
            return float(confidence)
        return float(np.interp(confidence, self.knots_x[d], self.knots_y[d]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "isotonic",
            "knots_x": [list(k) for k in self.knots_x],
            "knots_y": [list(k) for k in self.knots_y],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IsotonicCalibration:
        return cls(tuple(tuple(k) for k in d["knots_x"]), tuple(tuple(k) for k in d["knots_y"]))
