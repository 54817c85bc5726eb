"""Freeze a trained SB3 agent into the engine's artefact: TorchScript actor + JSON card (no SB3 needed after).

The actor is the deterministic path of the agent, always ending in action logits [B, sum(nvec)] whose argmax per
dimension is the grid action (engine.runtime.frozen):
- PPO (`ActorCriticPolicy`, MultiDiscrete): features (flatten) -> mlp_extractor.policy_net -> action_net;
- SAC / TD3 (Box [-1, 1]^4, env.actions): the deterministic action x = tanh(mu(latent)) -> `box_cells`, a fixed
  linear layer whose argmax per dimension is the Box cell floor((x + 1) / 2 · n) the environment decodes.
Observation normalisation (`VecNormalize` statistics, if any) is folded in front, so the frozen module takes the
raw observation vector that `engine.runtime.observation.Observation.vector()` returns.
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
from engine.runtime.frozen import FORMAT, FrozenActor
from engine.runtime.observation import OBS_DIM, OBS_SIGNATURE


def _mlp_card(net: nn.Module, clip: float) -> dict | None:
    """{"activation", "clip"} when the actor is Linear (Tanh Linear)* (SB3's MlpPolicy): the engine's loader
    then runs it in numpy (a few µs per round) instead of through TorchScript; None otherwise."""
    layers = list(net)
    ok = all(isinstance(m, nn.Linear) for m in layers[0::2]) and all(isinstance(m, nn.Tanh) for m in layers[1::2])
    return {"activation": "tanh", "clip": clip} if layers and ok and len(layers) % 2 == 0 else None


def box_cells(nvec: list[int]) -> nn.Linear:
    """Linear [len(nvec)] -> [sum(nvec)]: x_d ∈ [-1, 1] -> logits whose argmax over dimension d's block is the
    Box cell floor((x_d + 1) / 2 · n_d) (env.actions.ActionCodec; at a cell boundary itself the lower cell).

    Logit i of a block is i·x − Σ_{j<i} b_j with b_j = −1 + 2(j + 1)/n the boundary between cells j and j + 1:
    logit i − logit (i − 1) = x − b_{i−1}, so the argmax is the number of boundaries below x."""
    layer = nn.Linear(len(nvec), int(sum(nvec)))
    w = torch.zeros(int(sum(nvec)), len(nvec), dtype=torch.float64)
    b = torch.zeros(int(sum(nvec)), dtype=torch.float64)
    off = 0
    for d, n in enumerate(nvec):
        bounds = -1.0 + 2.0 * torch.arange(1, n, dtype=torch.float64) / n  # [n - 1]
        w[off : off + n, d] = torch.arange(n, dtype=torch.float64)
        b[off + 1 : off + n] = -torch.cumsum(bounds, 0)
        off += n
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def _actor_nets(policy: Any, grid: ActionGrid) -> tuple[nn.Module, nn.Module]:
    """(policy_net, action_net) of the agent's deterministic actor (module docstring)."""
    from gymnasium import spaces

    space = policy.action_space
    if isinstance(space, spaces.MultiDiscrete):
        if list(space.nvec) != grid.nvec:
            raise ValueError(f"agent's action space {list(space.nvec)} is not the grid's {grid.nvec}")
        return copy.deepcopy(policy.mlp_extractor.policy_net), copy.deepcopy(policy.action_net)
    if isinstance(space, spaces.Box):
        if space.shape != (len(grid.nvec),) or not (np.all(space.low == -1.0) and np.all(space.high == 1.0)):
            raise ValueError(f"agent's Box action space {space} is not env.actions' Box([-1, 1]^{len(grid.nvec)})")
        actor = policy.actor
        if getattr(actor, "use_sde", False):
            raise ValueError("a SAC actor with gSDE has no plain deterministic path to freeze (use_sde=False)")
        if hasattr(actor, "latent_pi"):  # SAC: the deterministic action is tanh(mu(latent_pi))
            layers = [*actor.latent_pi, actor.mu, nn.Tanh()]
        else:  # TD3: mu ends in Tanh
            layers = list(actor.mu)
        return nn.Sequential(*copy.deepcopy(layers)), box_cells(grid.nvec)
    raise ValueError(f"cannot freeze an agent with action space {space}: MultiDiscrete or Box([-1, 1]^4) only")


def freeze(model: Any, grid: ActionGrid, path: str | os.PathLike, vec_normalize: Any = None, **card: Any) -> Path:
    """Write `path/` = policy.pt + policy.json atomically (a temp folder renamed into place)."""
    policy = model.policy.to("cpu").eval()
    policy_net, action_net = _actor_nets(policy, grid)
    if vec_normalize is not None and vec_normalize.norm_obs:
        mean, var = vec_normalize.obs_rms.mean, vec_normalize.obs_rms.var
        clip, eps = float(vec_normalize.clip_obs), float(vec_normalize.epsilon)
    else:
        mean, var, clip, eps = np.zeros(OBS_DIM), np.ones(OBS_DIM), 1e9, 0.0
    std = torch.sqrt(torch.as_tensor(var, dtype=torch.float32) + eps)
    actor = FrozenActor(policy_net, action_net, mean, std, clip)
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
