"""A round's modelled cost from its RoundStats: T_spec = T_verify + T_draft and T_AR, by the roofline.

    from engine.cost.round_cost import serving_round_cost
    price = serving_round_cost(engine)                    # the served target + drafter on this machine's profile
    t_spec, t_ar = price(stats)                           # stats: one RoundStats; utility = committed * t_ar / t_spec

The Engine's `round_cost` signature (RoundStats -> (T_spec, T_AR)), priced with the same pieces as the rest of
engine.cost (DESIGN §1 utility, §2 cost models):

    T_verify  RooflineCost.counts_cost(tokens_per_expert, verified tokens, context): the round's own routing
              counts [L, E] (uniform routing when the engine recorded none)
    T_draft   DrafterRoofline.round_cost(built depth, width, context, λ > 0); 0 for K = 0 and for drafters
              without weights to read (n-gram)
    T_AR      RooflineCost.counts_cost(None, 1, context): one target-only decode step at the same context

so a round without drafts has utility exactly R · T_AR / T_spec = 1. The served model is priced as served
(its own config and dtype) on a hardware profile of conf/hardware: "auto" takes the CUDA device's profile by
name and the CPU placeholder profile otherwise. The server uses it for its per-request utility metric
(engine.serve.metrics); the policy's observation does not see it unless it is also passed as
`Engine(round_cost=...)`.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cost.drafter_cost import DrafterRoofline, DrafterSpec, drafter_spec_from_hf_config
from engine.cost.roofline import RooflineCost, load_hardware, model_spec_from_hf_config

# substrings of torch.cuda.get_device_name -> conf/hardware profile
_GPU_PROFILES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("rtx 6000 ada", "rtx6000ada"))


class RooflineRoundCost:
    """RoundStats -> (T_spec, T_AR) in modelled seconds (module docstring)."""

    def __init__(self, target: RooflineCost, drafter: DrafterRoofline | None = None) -> None:
        if target.layout is not None:
            raise ValueError("RooflineRoundCost prices rounds without an EP layout")
        self.target, self.drafter = target, drafter
        self.name = f"roofline:{target.hw.name}:{target.spec.name}" + (f":{drafter.spec.name}" if drafter else "")

    def __call__(self, stats: Any) -> tuple[float, float]:
        ctx = int(stats.context_len)
        verify = self.target.counts_cost(stats.tokens_per_expert, int(stats.verified_tokens), ctx)
        draft = 0.0
        if self.drafter is not None and stats.built_depth > 0:
            draft = self.drafter.round_cost(int(stats.built_depth), int(stats.width), ctx, stats.lam > 0)
        return verify + draft, self.target.counts_cost(None, 1, ctx)


def default_hardware(device: torch.device | str = "cpu") -> str:
    """The conf/hardware profile of `device`: a CUDA device's by its name (H200, H100, A100, RTX 6000 Ada; H100 for
    other GPUs), "cpu" otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((profile for key, profile in _GPU_PROFILES if key in name), "h100")


def serving_round_cost(engine: Any, hardware: str = "auto") -> RooflineRoundCost:
    """The round cost of an `engine.Engine`'s target and drafter on `hardware` ("auto": `default_hardware`).

    A dense drafter model is priced by its own config; a feature head (EAGLE / MTP) as a one-layer head at the
    target's size; a drafter without a model of its own (n-gram, a custom Drafter) drafts for free. Raises
    ValueError for a target that is not a supported MoE config or an unknown hardware profile."""
    target = engine.target
    if hardware == "auto":
        hardware = default_hardware(target.device)
    hw = load_hardware(hardware)
    nbytes = float(target.dtype.itemsize)
    try:
        spec = model_spec_from_hf_config(target.config.raw, name="target", weight_bytes=nbytes)
    except KeyError as err:
        raise ValueError(f"the target's config has no {err} field: the roofline prices MoE targets") from err
    return RooflineRoundCost(RooflineCost(hw, spec), _drafter_roofline(hw, engine.drafter, target.config.raw))


def _drafter_roofline(hw: Any, drafter: Any, target_config: dict) -> DrafterRoofline | None:
    model = getattr(drafter, "model", None)  # engine.drafting.model_drafter.ModelDrafter
    spec: DrafterSpec | None = None
    if model is not None and hasattr(model, "config"):
        spec = drafter_spec_from_hf_config(model.config.raw, "dense", "drafter", float(model.dtype.itemsize))
    elif getattr(drafter, "head", None) is not None:  # engine.drafting.feature_drafter (EAGLE / MTP heads)
        spec = drafter_spec_from_hf_config(target_config, "eagle3", "target_head", float(drafter.target.dtype.itemsize))
    return None if spec is None else DrafterRoofline(hw, spec)
