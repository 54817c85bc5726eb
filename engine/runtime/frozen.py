"""Load a frozen learned policy: a small TorchScript actor + its JSON card, no SB3 at inference.

A frozen policy folder (written by `ctrl.freeze.freeze`) holds

    policy.pt     TorchScript module: observation vector [B, OBS_DIM] -> action logits [B, sum(nvec)]
                  (observation normalisation folded in)
    policy.json   {"format": "expertspec-policy-v1", "obs_signature": OBS_SIGNATURE, "action_grid": {...},
                   "nvec": [...], "calibration": {isotonic knots} | null, "acceptance": {...} | null,
                   "probe": [depth, width] | null, "probe_source": "drafter" | "context" | absent,
                   "hold": {"rounds": n, "after": "plain" | "declined"} | absent, "algo": ..., ...}

`load_frozen_policy(path)` returns a plain callable `obs -> SpecConfig` (deterministic: argmax per action
dimension) that the engine takes as `policy=`; it refuses a policy made for another observation layout.
A policy that observes its drafter's own probe (`probe_source` "drafter": the prompt lookup's) decodes plainly
without asking its actor when the probe proposes nothing (`unproposed`): no action would draft anything then.
Its `hold` (engine.runtime.hold; none when absent) is the plain decoding the session then holds unasked.
The engine imports neither env nor ctrl: this loader lives beside the observation function.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.drafting.acceptance import AcceptanceModel
from engine.runtime.action_grid import ActionGrid
from engine.runtime.hold import Hold
from engine.runtime.observation import (
    KMAX,
    OBS_DIM,
    OBS_FIELDS,
    OBS_SIGNATURE,
    Calibration,
    History,
    Observation,
    as_vector,
    observation_values,
)
from engine.spec.calibration import IsotonicCalibration
from engine.spec.config import SpecConfig
from kernels import tanh_mlp

FORMAT = "expertspec-policy-v1"
CAL_SLICE = slice(OBS_FIELDS.index("confidence_cal_last_1"), OBS_FIELDS.index(f"confidence_cal_last_{KMAX}") + 1)
NOW_SLICE = slice(OBS_FIELDS.index("confidence_now_1"), OBS_FIELDS.index(f"confidence_now_{KMAX}") + 1)


class FrozenPolicy:
    """Deterministic frozen actor: Observation (or its vector) -> SpecConfig on the stored action grid."""

    def __init__(self, module: torch.jit.ScriptModule, card: dict[str, Any]) -> None:
        self.module = module.eval()
        self.card = card
        self.grid = ActionGrid.from_dict(card["action_grid"])
        self.nvec = list(card["nvec"])
        self.name = card.get("name", "learned")
        self.hold = Hold.of(card.get("hold"))  # a bad entry: a clear error at load
        cal = card.get("calibration")
        self.calibration = IsotonicCalibration.from_dict(cal) if cal else None
        acc = card.get("acceptance")
        self.acceptance = AcceptanceModel.from_dict(acc) if acc else None  # the "calibrated" rule's model
        if self.acceptance is None and self.grid.needs_acceptance:
            raise ValueError("frozen policy: its action grid has the 'calibrated' rule but the card stores no "
                             "acceptance model (retrain it with `python -m ctrl.train`)")  # fmt: skip
        ends = np.cumsum(self.nvec)
        self._slices = [(int(e - n), int(e)) for n, e in zip(self.nvec, ends)]
        self._specs: dict[tuple[int, ...], SpecConfig] = {}
        self._table = False  # the C++ actor's action table is filled (chooser)
        self._mlp = m = _numpy_mlp(module, card.get("mlp"), self.nvec)
        # the C++ twin of the numpy actor (kernels.tanh_mlp): one call between two rounds instead of a dozen
        self._native = tanh_mlp.actor(m.lo, m.hi, [*m.hidden, (m.w_out, m.b_out)], m.dims) if m else None
        if self._native is not None:  # its `choose` computes the observation values too, with this calibration
            self._native.observe(KMAX, self.calibration)
        if self.nvec != self.grid.nvec:
            raise ValueError(f"frozen policy: nvec {self.nvec} does not match its action grid {self.grid.nvec}")
        # trained on this round's probed draft confidence (`confidence_now`): the engine probes (depth, width) first
        probe = card.get("probe")
        self.probe: tuple[int, int] | None = (int(probe[0]), int(probe[1])) if probe else None
        # a probe of the drafter's own (the prompt lookup's) that proposes nothing leaves nothing to draft: plain
        # decoding then, without the observation or the actor (`unproposed`); a context probe never skips
        own = self.probe is not None and card.get("probe_source") == "drafter" and 0 in self.grid.depths
        self.plain_index: tuple[int, ...] | None = (self.grid.depths.index(0), 0, 0, 0) if own else None
        if self._native is not None and own:
            self._native.set_plain(self.plain_index)

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        """The actor's hidden layer widths (the `policy_net` Linear layers' output sizes), e.g. (64, 64)."""
        sd = self.module.state_dict()
        return tuple(int(sd[f"policy_net.{i}.weight"].shape[0]) for i in _linear_ids(sd))

    def act_index(self, vector: np.ndarray | list[float]) -> tuple[int, ...]:
        """Observation vector [OBS_DIM] (or its values, `observation_values`) -> action indices (argmax per
        MultiDiscrete dimension); plain decoding's where the probe proposed nothing (`unproposed`)."""
        if self.plain_index is not None and unproposed(vector[NOW_SLICE]):
            return self.plain_index
        if self._native is not None:  # the C++ actor: one call
            return self._native.act(vector if isinstance(vector, list) else np.asarray(vector).tolist())
        if self._mlp is not None:  # padded logits [D, max n]: one argmax for every dimension
            return tuple(self._mlp_logits(vector).reshape(self._mlp.dims, -1).argmax(1).tolist())
        logits = self.logits(vector)
        return tuple(int(logits[a:b].argmax()) for a, b in self._slices)

    def logits(self, vector: np.ndarray | list[float]) -> np.ndarray:
        """Action logits [sum(nvec)]: the numpy twin of the TorchScript actor when it is a plain MLP."""
        if self._mlp is not None:
            return self._mlp_logits(vector)[self._mlp.keep]
        x = torch.from_numpy(as_vector(vector).reshape(1, -1))
        with torch.no_grad():
            return self.module(x)[0].numpy()

    def _mlp_logits(self, vector: np.ndarray | list[float]) -> np.ndarray:
        """Padded logits [D * max n] of the numpy twin (_NumpyMLP), padding at -inf."""
        m = self._mlp
        x = np.minimum(np.maximum(as_vector(vector), m.lo), m.hi)  # -> float64, the normalisation clip in input space
        for w, b in m.hidden:
            x = np.dot(w, x)
            np.tanh(np.add(x, b, out=x), out=x)
        return np.add(np.dot(m.w_out, x), m.b_out)

    def act_vector(self, vector: np.ndarray | list[float]) -> SpecConfig:
        """Observation vector [OBS_DIM] or its values (its calibrated block from `self.calibration`) -> SpecConfig."""
        return self._spec(self.act_index(vector))

    def act_history(
        self,
        h: History,
        *,
        position: int,
        max_new_tokens: int,
        batch_size: int,
        top_k: int,
        num_moe_layers: int,
        calibration: Calibration | None = None,
        probe: list[float] | tuple[float, ...] = (),
    ) -> SpecConfig:
        """The action before a request's next round, from its running History (what the engine's session calls):
        `act_vector(observation_values(h, ...))`, the calibrated block from `self.calibration`, else from
        `calibration` (the engine's). With the C++ actor and the policy's own map (or none at all) one call computes
        the values and the decision (kernels.tanh_mlp `choose`, equal values: tested). `probe`: this round's draft
        confidence per depth (`confidence_now`; the engine's Session.probe when the policy has `probe`)."""
        own = self.calibration
        if self.plain_index is not None and probe is not None and unproposed(probe[:KMAX]):
            return self._spec(self.plain_index)
        if self._native is not None and (own is not None or calibration is None):
            try:
                return self._spec(self._native.choose(h, position, max_new_tokens, batch_size, top_k, num_moe_layers,
                                                      probe))  # fmt: skip
            except (TypeError, ValueError, OverflowError):  # a History the C++ reader does not take: the Python twin
                pass
        v = observation_values(h, position=position, max_new_tokens=max_new_tokens, batch_size=batch_size,
                               calibration=own if own is not None else calibration, top_k=top_k,
                               num_moe_layers=num_moe_layers, probe=probe)  # fmt: skip
        return self.act_vector(v)

    def chooser(self, calibration: Calibration | None = None) -> Callable[..., SpecConfig] | None:
        """`act_history`'s C++ path bound once for a session, positional: (h, position, max_new_tokens, batch_size,
        top_k, num_moe_layers, probe) -> SpecConfig, the same decisions and the same SpecConfig object (the policy's
        cache, which lets the session validate each action once) in one native call, without act_history's keyword,
        dispatch and action lookup work each round. It raises TypeError, ValueError or OverflowError on a History the
        C++ reader does not take: the caller then asks `act_history` (its Python twin). None where act_history would
        take its Python path (no C++ actor; the engine's `calibration` and none of the policy's own)."""
        if self._native is None or (self.calibration is None and calibration is not None):
            return None
        if not self._table:  # the C++ action table, filled from the policy's SpecConfig cache (no cycle through it)
            self._native.set_actions(self.nvec, partial(_make_spec, self.grid, self.acceptance, self._specs))
            self._table = True
        return self._native.choose_action

    def _spec(self, idx: tuple[int, ...]) -> SpecConfig:
        """The SpecConfig of action indices (cached; the calibrated rule carries the policy's acceptance model)."""
        return _make_spec(self.grid, self.acceptance, self._specs, idx)

    def reset(self) -> None:
        """Stateless: nothing to forget between requests."""

    def act(self, obs: Observation) -> SpecConfig:
        """Observation -> SpecConfig. With a stored calibration, the calibrated confidences are recomputed from
        the raw ones with it (the map the policy was trained with), whatever the caller's engine used."""
        v = obs.vector()
        cal = self.calibration
        if cal is not None:  # the calibrated block of the vector (observation module's layout), clipped to [0, 1]
            conf = obs.confidence_last
            v[CAL_SLICE] = [min(max(cal(c, d + 1), 0.0), 1.0) if c > 0 else 0.0 for d, c in enumerate(conf)]
        return self.act_vector(v)

    __call__ = act


def unproposed(confidences: Sequence[float] | np.ndarray) -> bool:
    """Whether a probe's confidences per depth (`confidence_now`; empty where the depth was capped to 0) propose
    nothing: all 0. The prompt lookup's then found no match, so no action drafts anything and every one decodes one
    token; plain decoding (K = 0) is the cheapest of them. The C++ twin: kernels.tanh_mlp `unproposed`."""
    return not any(c != 0.0 for c in confidences)


def _make_spec(grid: ActionGrid, acceptance: AcceptanceModel | None, cache: dict[tuple[int, ...], SpecConfig],
               idx: tuple[int, ...]) -> SpecConfig:  # fmt: skip
    """The SpecConfig of action indices on `grid`, made once and kept in `cache` (the calibrated rule carries
    `acceptance`, the model the policy was trained with)."""
    spec = cache.get(idx)
    if spec is not None:
        return spec
    spec = grid.spec(idx)
    if spec.verify_rule == "calibrated":
        spec = replace(spec, acceptance=acceptance)
    cache[idx] = spec
    return spec


@dataclass(frozen=True)
class _NumpyMLP:
    """A Linear (Tanh Linear)* actor stored by ctrl.freeze, as float64 numpy arrays in the fewest calls.

    The observation normalisation (x - mean) / std clipped to ±clip is folded: the clip moves to input space
    ([lo, hi] = mean ∓ clip·std) and the affine map into the first layer; the output layer is padded to
    [D · max n] rows with -inf biases so one argmax answers every action dimension. Between two engine rounds
    (caches cold) every numpy call costs a few µs, and float64 gemv of these sizes is ~3x faster than float32
    there. The logits equal the float32 TorchScript actor's to ~1e-6 (tested). It is the reference twin of the C++
    actor (kernels.tanh_mlp, same decisions: tested); the engine and the environments both act through the C++ one
    when it is built, else through this one, so their decisions are the same."""

    lo: np.ndarray  # [OBS_DIM]
    hi: np.ndarray  # [OBS_DIM]
    hidden: list[tuple[np.ndarray, np.ndarray]]  # [(W [h_out, h_in], b [h_out])], first layer normalisation-folded
    w_out: np.ndarray  # [D * max n, h]
    b_out: np.ndarray  # [D * max n]
    keep: np.ndarray  # [sum(nvec)] rows of the padded output that are real logits
    dims: int  # D, the action dimensions


def _linear_ids(state_dict: Mapping[str, Any]) -> list[int]:
    """The indices of the actor's hidden Linear layers in its `policy_net` (Sequential), in order."""
    return sorted({int(k.split(".")[1]) for k in state_dict if k.startswith("policy_net.")})


def _numpy_mlp(module: torch.jit.ScriptModule, mlp: dict | None, nvec: list[int]) -> _NumpyMLP | None:
    """The numpy twin of a plain tanh-MLP actor (ctrl.freeze's `mlp` card entry), or None for any other actor."""
    if not mlp or mlp.get("activation") != "tanh":
        return None
    sd = {k: v.detach().numpy().astype(np.float64) for k, v in module.state_dict().items()}
    layers = [(sd[f"policy_net.{i}.weight"], sd[f"policy_net.{i}.bias"]) for i in _linear_ids(sd)]
    layers.append((sd["action_net.weight"], sd["action_net.bias"]))
    mean, std, clip = sd["mean"], sd["std"], float(mlp["clip"])
    w0, b0 = layers[0]
    w0 = w0 / std  # W ((x - mean) / std) + b = (W / std) x + (b - (W / std) mean)
    layers[0] = (w0, b0 - w0 @ mean)
    w, b = layers.pop()
    width = max(nvec)
    keep = np.concatenate([d * width + np.arange(n) for d, n in enumerate(nvec)])
    w_out = np.zeros((len(nvec) * width, w.shape[1]))
    b_out = np.full(len(nvec) * width, -np.inf)
    w_out[keep], b_out[keep] = w, b
    return _NumpyMLP(mean - clip * std, mean + clip * std, layers, w_out, b_out, keep, len(nvec))


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
    try:
        Hold.of(card.get("hold"))
    except ValueError as err:
        raise ValueError(f"{card_path}: {err}") from None
    return FrozenPolicy(torch.jit.load(str(module_path), map_location="cpu"), card)


class FrozenActor(torch.nn.Module):
    """The actor a frozen policy stores (ctrl.freeze traces it; `_numpy_mlp` reads its layout back): observation
    [B, OBS_DIM] -> clamp((obs - mean) / std, ±clip) -> `policy_net` -> `action_net` -> logits [B, sum(nvec)]."""

    def __init__(self, policy_net: torch.nn.Module, action_net: torch.nn.Module, mean: Any, std: Any,
                 clip: float) -> None:  # fmt: skip
        super().__init__()
        self.policy_net, self.action_net = policy_net, action_net
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))
        self.clip = clip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = torch.clamp((obs - self.mean) / self.std, -self.clip, self.clip)
        return self.action_net(self.policy_net(x))


STAND_IN_HIDDEN = (64, 64)  # the main job's actor (ctrl.config.AlgoConf.net_arch's default)


def stand_in_policy(
    grid: ActionGrid,
    hidden: tuple[int, ...] = STAND_IN_HIDDEN,
    probe: tuple[int, int] | None = None,
    calibration: IsotonicCalibration | None = None,
    seed: int = 0,
) -> FrozenPolicy:
    """A frozen policy of a learned one's shape (OBS_DIM -> `hidden` tanh layers -> the grid's logits; the main
    job's actor is (64, 64)) with random weights whose depth head always picks K = 0: a learned controller's choice,
    observation values, calibration, actor and action check, at its cost, before any policy is trained (the host
    calibration times it in place before its live K = 0 rounds, env.host_calibration). `probe`: the (depth, width)
    it has the engine probe first, as a policy trained on the probe."""
    if 0 not in grid.depths:
        raise ValueError(f"stand-in policy: its grid needs depth 0 (depths {grid.depths})")
    gen = torch.Generator().manual_seed(seed)
    dims = [OBS_DIM, *hidden]
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=gen) / a**0.5)
            lin.bias.zero_()
        layers += [lin, torch.nn.Tanh()]
    out = torch.nn.Linear(dims[-1], sum(grid.nvec))
    with torch.no_grad():
        out.weight.copy_(torch.randn(out.out_features, dims[-1], generator=gen) / dims[-1] ** 0.5)
        out.bias.zero_()
        out.bias[grid.depths.index(0)] = 1e3  # the depth head: K = 0 whatever the observation
    card = dict(format=FORMAT, obs_signature=OBS_SIGNATURE, obs_dim=OBS_DIM, action_grid=grid.to_dict(),
                nvec=grid.nvec, mlp={"activation": "tanh", "clip": 1e9}, name="stand-in",
                calibration=calibration.to_dict() if calibration is not None else None,
                probe=list(probe) if probe else None)  # fmt: skip
    actor = FrozenActor(torch.nn.Sequential(*layers), out, torch.zeros(OBS_DIM), torch.ones(OBS_DIM), 1e9)
    return FrozenPolicy(actor.eval(), card)
