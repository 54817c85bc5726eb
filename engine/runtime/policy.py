"""Policy I/O: what a policy may return, validated once, with one clear message.

A policy is a plain callable `obs -> action` (the engine never imports `env` or `ctrl`); `obs` is the
`engine.runtime.observation.Observation` of the request about to run a round. An action is a
`SpecConfig`, a mapping of SpecConfig fields, or a (K,), (K, W) or (K, W, λ) sequence / array.

A policy may also offer `act_vector(values) -> action`, taking the observation vector instead: either
`Observation.vector()` [OBS_DIM] or its values before the float32 rounding and [0, 1] clip (`as_vector`, idempotent),
which is what the session passes: `observation_values`, computed straight from the request's history without
building the Observation or calling numpy, its calibrated block from the policy's `calibration` attribute when that
is not None, else from the engine's. A policy may instead offer `act_history(history, *, position, max_new_tokens,
batch_size, top_k, num_moe_layers, calibration, probe) -> action`, computing the values itself (the session then calls
it, `calibration` the engine's): the frozen learned policy (`engine.runtime.frozen`) does, in one C++ call.

A policy with a `probe` attribute (depth, width) observes this round's draft before choosing: the session first asks
the drafter's `probe` for the draft confidence per depth of a tree of that shape (`Session.probe`; drafters without
one give none) and passes it as the observation's `confidence_now` (`probe=` of the calls above); with a drafter that
has `probed_source` (the prompt lookup) the probe's values carry where its match comes from too (`match_now`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from engine.spec.config import SpecConfig

Policy = Callable[[Any], Any]
_SPEC_FIELDS = {f.name for f in fields(SpecConfig)}
ACTION_HELP = "expected a SpecConfig, a dict of SpecConfig fields, or (K,), (K, W), (K, W, λ) numbers"


def _integer(x: Any, name: str, action: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not float(x).is_integer():
        raise ValueError(f"action {action!r}: {name} must be an integer, got {x!r}; {ACTION_HELP}")
    return int(x)


def coerce_action(action: Any) -> SpecConfig:
    """A policy's action -> SpecConfig, or a ValueError saying what was wrong and what is expected.

    Every form goes through SpecConfig's own validation, so (K, 0) and SpecConfig(width=0) fail alike.
    """
    if isinstance(action, SpecConfig):
        return action
    if isinstance(action, Mapping):
        unknown = sorted(set(action) - _SPEC_FIELDS)
        if unknown:
            known = sorted(_SPEC_FIELDS)
            raise ValueError(f"action {dict(action)!r}: unknown fields {unknown}; SpecConfig has {known}")
        return SpecConfig(**action)
    if isinstance(action, (str, bytes)) or action is None:
        raise ValueError(f"action {action!r}: {ACTION_HELP}")
    try:
        seq = list(action.tolist() if hasattr(action, "tolist") else action)
    except TypeError as err:
        raise ValueError(f"action {action!r}: {ACTION_HELP}") from err
    if not 1 <= len(seq) <= 3:
        raise ValueError(f"action {seq!r} has {len(seq)} numbers; {ACTION_HELP}")
    K = _integer(seq[0], "K", action)
    W = _integer(seq[1], "W", action) if len(seq) > 1 else 1
    lam = seq[2] if len(seq) > 2 else 0.0
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not math.isfinite(float(lam)):
        raise ValueError(f"action {action!r}: λ must be a finite number, got {lam!r}")
    return SpecConfig(depth=K, width=W, lam=float(lam))
