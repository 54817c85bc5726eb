"""Freeze a trained SB3 agent into the engine's artefact: TorchScript actor + JSON card (no SB3 needed after).

The actor is the deterministic path of an SB3 `ActorCriticPolicy` with a MultiDiscrete action space:
features (flatten) -> mlp_extractor.policy_net -> action_net -> logits [B, sum(nvec)]; observation
normalisation (`VecNormalize` statistics, if any) is folded in front, so the frozen module takes the raw
observation vector that `engine.runtime.observation.Observation.vector()` returns.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.runtime.action_grid import ActionGrid
from engine.runtime.frozen import FORMAT
from engine.runtime.observation import OBS_DIM, OBS_SIGNATURE


class _Actor(nn.Module):
    def __init__(self, policy_net: nn.Module, action_net: nn.Module, mean, var, clip: float, eps: float) -> None:
        super().__init__()
        self.policy_net, self.action_net = policy_net, action_net
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.sqrt(torch.as_tensor(var, dtype=torch.float32) + eps))
        self.clip = clip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = torch.clamp((obs - self.mean) / self.std, -self.clip, self.clip)
        return self.action_net(self.policy_net(x))


def _mlp_card(net: nn.Module, clip: float) -> dict | None:
    """{"activation", "clip"} when the actor is Linear (Tanh Linear)* (SB3's MlpPolicy): the engine's loader
    then runs it in numpy (a few µs per round) instead of through TorchScript; None otherwise."""
    layers = list(net)
    ok = all(isinstance(m, nn.Linear) for m in layers[0::2]) and all(isinstance(m, nn.Tanh) for m in layers[1::2])
    return {"activation": "tanh", "clip": clip} if layers and ok and len(layers) % 2 == 0 else None


def freeze(model: Any, grid: ActionGrid, path: str | os.PathLike, vec_normalize: Any = None, **card: Any) -> Path:
    """Write `path/` = policy.pt + policy.json atomically (a temp folder renamed into place)."""
    policy = model.policy.to("cpu").eval()
    if list(policy.action_space.nvec) != grid.nvec:
        raise ValueError(f"agent's action space {list(policy.action_space.nvec)} is not the grid's {grid.nvec}")
    if vec_normalize is not None and vec_normalize.norm_obs:
        mean, var = vec_normalize.obs_rms.mean, vec_normalize.obs_rms.var
        clip, eps = float(vec_normalize.clip_obs), float(vec_normalize.epsilon)
    else:
        mean, var, clip, eps = np.zeros(OBS_DIM), np.ones(OBS_DIM), 1e9, 0.0
    actor = _Actor(copy.deepcopy(policy.mlp_extractor.policy_net), copy.deepcopy(policy.action_net),
                   mean, var, clip, eps)  # fmt: skip
    scripted = torch.jit.trace(actor.eval(), torch.zeros(1, OBS_DIM))  # a plain MLP: tracing is exact
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".freeze-", dir=out.parent))
    try:
        scripted.save(str(tmp / "policy.pt"))
        meta = dict(format=FORMAT, obs_signature=OBS_SIGNATURE, obs_dim=OBS_DIM, action_grid=grid.to_dict(),
                    nvec=grid.nvec, mlp=_mlp_card(actor.policy_net, clip), **card)  # fmt: skip
        (tmp / "policy.json").write_text(json.dumps(meta, indent=2, default=str))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
