"""Speculation policies: static settings and the published adaptive rules, behind one interface (base.py).

from ctrl.policies import make_policy, as_callable
policy = make_policy("cascade", k_max=6)
eng.generate(prompts, 128, policy=as_callable(policy))

name              class                  source
static            StaticPolicy           fixed (K, W, λ, verification rule)
cascade           CascadePolicy          Cascade, arXiv 2506.20675
goodput / evict   GoodputPolicy          EVICT, arXiv 2605.00342 (engine verify_rule="goodput")
ucb               UCBPolicy              BanditSpec, arXiv 2505.15141 (UCB1 over (K, W) arms)
sglang-adaptive   SGLangAdaptivePolicy   sglang srt/speculative/adaptive_spec_params.py
vllm-table        VLLMTablePolicy        vllm v1/spec_decode/dynamic/utils.py
vllm-goodput      VLLMGoodputPolicy      vllm v1/spec_decode/dynamic/manager.py
disco             ConfidencePolicy       DISCO 2405.04304 / SpecDec++ 2405.19715 (threshold | calibrated rule)
"""

from __future__ import annotations

import inspect
from typing import Any

from ctrl.policies.base import Policy, as_callable, check_action
from ctrl.policies.cascade import CascadePolicy
from ctrl.policies.disco import ConfidencePolicy
from ctrl.policies.goodput import GoodputPolicy
from ctrl.policies.sglang import SGLangAdaptivePolicy
from ctrl.policies.static import StaticPolicy
from ctrl.policies.ucb import UCBPolicy
from ctrl.policies.vllm import VLLMGoodputPolicy, VLLMTablePolicy

POLICIES: dict[str, type] = {
    "static": StaticPolicy,
    "cascade": CascadePolicy,
    "goodput": GoodputPolicy,
    "evict": GoodputPolicy,
    "ucb": UCBPolicy,
    "sglang-adaptive": SGLangAdaptivePolicy,
    "vllm-table": VLLMTablePolicy,
    "vllm-goodput": VLLMGoodputPolicy,
    "disco": ConfidencePolicy,
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """A policy by name with its constructor's keyword arguments; ValueError for an unknown name or argument."""
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    sig = inspect.signature(cls)
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: {e}; it takes {list(sig.parameters)}") from None
    return cls(**kwargs)


__all__ = [
    "POLICIES",
    "CascadePolicy",
    "ConfidencePolicy",
    "GoodputPolicy",
    "Policy",
    "SGLangAdaptivePolicy",
    "StaticPolicy",
    "UCBPolicy",
    "VLLMGoodputPolicy",
    "VLLMTablePolicy",
    "as_callable",
    "check_action",
    "make_policy",
]
