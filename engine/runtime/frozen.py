"""Load a frozen learned policy: a small TorchScript actor + its JSON card, no SB3 at inference.

A frozen policy folder (written by `ctrl.freeze.freeze`) holds

    policy.pt     TorchScript module: observation vector [B, OBS_DIM] -> action logits [B, sum(nvec)]
                  (observation normalisation folded in)
    policy.json   {"format": "expertspec-policy-v1", "obs_signature": OBS_SIGNATURE, "action_grid": {...},
                   "nvec": [...], "calibration": {isotonic knots} | null, "algo": ..., ...}

`load_frozen_policy(path)` returns a plain callable `obs -> SpecConfig` (deterministic: argmax per action
dimension) that the engine takes as `policy=`; it refuses a policy made for another observation layout.
The engine imports neither env nor ctrl: this loader lives beside the observation function.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.runtime.action_grid import ActionGrid
from engine.runtime.calibration import IsotonicCalibration
from engine.runtime.observation import OBS_DIM, OBS_SIGNATURE, Observation
from engine.spec.config import SpecConfig

FORMAT = "expertspec-policy-v1"


class FrozenPolicy:
    """Deterministic frozen actor: Observation (or its vector) -> SpecConfig on the stored action grid."""

    def __init__(self, module: torch.jit.ScriptModule, card: dict[str, Any]) -> None:
        self.module = module.eval()
        self.card = card
        self.grid = ActionGrid.from_dict(card["action_grid"])
        self.nvec = list(card["nvec"])
        self.name = card.get("name", "learned")
        cal = card.get("calibration")
        self.calibration = IsotonicCalibration.from_dict(cal) if cal else None
        if self.nvec != self.grid.nvec:
            raise ValueError(f"frozen policy: nvec {self.nvec} does not match its action grid {self.grid.nvec}")

    def act_index(self, vector: np.ndarray) -> tuple[int, ...]:
        """Observation vector [OBS_DIM] -> action indices (argmax per MultiDiscrete dimension)."""
        x = torch.as_tensor(np.asarray(vector, dtype=np.float32)).reshape(1, -1)
        with torch.inference_mode():
            logits = self.module(x)[0]
        out, start = [], 0
        for n in self.nvec:
            out.append(int(logits[start : start + n].argmax()))
            start += n
        return tuple(out)

    def reset(self) -> None:
        """Stateless: nothing to forget between requests."""

    def act(self, obs: Observation) -> SpecConfig:
        """Observation -> SpecConfig. With a stored calibration, the calibrated confidences are recomputed from
        the raw ones with it (the map the policy was trained with), whatever the caller's engine used."""
        if self.calibration is not None:
            cal = tuple(self.calibration(c, d + 1) if c > 0 else 0.0 for d, c in enumerate(obs.confidence_last))
            obs = replace(obs, confidence_cal_last=cal)
        return self.grid.spec(self.act_index(obs.vector()))

    __call__ = act


def load_frozen_policy(path: str | os.PathLike) -> FrozenPolicy:
    """A frozen policy folder -> FrozenPolicy; clear errors for a missing or foreign artefact."""
    folder = Path(path)
    card_path, module_path = folder / "policy.json", folder / "policy.pt"
    if not card_path.is_file() or not module_path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a frozen policy folder (needs policy.json and policy.pt; make one with "
            "`python -m ctrl.train`)"
        )
    card = json.loads(card_path.read_text())
    if card.get("format") != FORMAT:
        raise ValueError(f"{card_path}: format {card.get('format')!r}, expected {FORMAT!r}")
    if card.get("obs_signature") != OBS_SIGNATURE:
        raise ValueError(
            f"{folder}: trained for observation layout {card.get('obs_signature')!r}, but this engine computes "
            f"{OBS_SIGNATURE!r} ({OBS_DIM} features); retrain the policy (`python -m ctrl.train`)"
        )
    return FrozenPolicy(torch.jit.load(str(module_path), map_location="cpu"), card)
