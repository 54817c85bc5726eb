"""The one policy interface, the adapter to the engine's plain callable, and argument checks.

A policy is any object with

    name: str                                   short id (the `make_policy` name)
    reset() -> None                             start of a request
    act(obs: Observation) -> SpecConfig         before every round of that request

`act` is called once per round; the outcome of the previous action arrives in the next Observation
(`accepted_last`, `committed_last`, `depth_last`, `cost_last` = T_spec, `cost_ar` = T_AR,
`utility_last` = R·T_AR/T_spec, `batch_size`, ...). Stateful policies keep their state inside.
Every action is a valid `SpecConfig` with depth K in 0..KMAX and width W >= 1 (`check_action`).

The engine takes a plain callable (DESIGN.md §2, §4: `engine` never imports `ctrl`):

    eng.generate(prompts, n, policy=as_callable(make_policy("cascade")))

Observations carry the request id, so `as_callable` keeps one copy of a per-request policy for every
request of a batch (reset at its first round); a policy whose state is meant to be shared across
requests (a bandit learning over the whole workload, SGLang's server-wide EMA) sets `shared = True`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation

__all__ = ["KMAX", "Policy", "as_callable", "check_action", "make_spec"]


@runtime_checkable
class Policy(Protocol):
    """Chooses the speculation settings of the next round of one request."""

    name: str

    def reset(self) -> None:
        """Forget the request in flight (a new request starts)."""
        ...

    def act(self, obs: Observation) -> SpecConfig:
        """Settings for the round about to run; `obs` reports the rounds so far."""
        ...


def as_callable(policy: Policy, reset_on_first_round: bool = True) -> Callable[[Observation], SpecConfig]:
    """The plain `obs -> SpecConfig` callable the engine takes; checks every action it returns.

    Per-request policies get one deep copy per `obs.request_id` (so a batch never mixes their state);
    `shared = True` policies are used as they are.
    """
    if not callable(getattr(policy, "act", None)) or not callable(getattr(policy, "reset", None)):
        raise TypeError(f"as_callable needs a Policy (reset() and act(obs)), got {type(policy).__name__}")
    shared = bool(getattr(policy, "shared", False))
    copies: dict[int, Policy] = {}

    def policy_fn(obs: Observation) -> SpecConfig:
        p = policy
        if not shared:
            if obs.round_index == 0 or obs.request_id not in copies:
                copies[obs.request_id] = copy.deepcopy(policy)
            p = copies[obs.request_id]
        if reset_on_first_round and obs.round_index == 0:
            p.reset()
        return check_action(p.act(obs))

    policy_fn.policy = policy  # type: ignore[attr-defined]
    policy_fn.__name__ = f"policy_{getattr(policy, 'name', type(policy).__name__)}"
    return policy_fn


def make_spec(depth: int, width: int = 1, lam: float = 0.0, **fields: Any) -> SpecConfig:
    """A SpecConfig whose depth is also within the observation's KMAX (SpecConfig validates the rest)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= KMAX:
        raise ValueError(f"depth K must be an int in 0..{KMAX} (observation KMAX), got {depth!r}")
    return SpecConfig(depth=depth, width=width, lam=lam, **fields)


def check_action(action: object) -> SpecConfig:
    """`action` itself if it is a SpecConfig with K in 0..KMAX and W >= 1, else ValueError."""
    if not isinstance(action, SpecConfig):
        raise ValueError(f"a policy must return an engine.SpecConfig, got {type(action).__name__}")
    if not 0 <= action.depth <= KMAX or action.width < 1:
        raise ValueError(f"policy action out of range: K={action.depth} (0..{KMAX}), W={action.width} (>= 1)")
    return action


# ---------------------------------------------------------------------------- argument checks
# Constructors call these before any work so a bad argument fails with its name in the message.


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int in {rng}, got {value!r}")
    return value


def check_float(name: str, value: object, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be a finite number in {left}{lo}, {hi}], got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_lam(lam: object) -> float:
    return check_float("lam (λ)", lam, 0.0)


def check_width(width: object, name: str = "width W") -> int:
    check_int(name, width, 1)
    try:  # SpecConfig owns the upper bound
        SpecConfig(depth=0, width=width)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return width  # type: ignore[return-value]


def check_costs(name: str, values: object) -> tuple[float, ...]:
    """A non-empty sequence of positive finite numbers (a profiled cost curve), as a tuple of floats."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of positive numbers, got {values!r}")
    return tuple(check_float(f"{name}[{i}]", v, 0.0, lo_open=True) for i, v in enumerate(values))
