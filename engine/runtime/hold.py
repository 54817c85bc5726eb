"""Holding plain decoding: a controller's choice of K = 0 kept for the request's next rounds, unasked.

A learned controller pays for every round it is asked: its probe, its choice, and the caches both cool before the
round's forward (engine.cost.fitted's `choice`). Where it chooses plain decoding, the next round is often plain too,
and asking again costs as much as a round's speculation would gain. `Hold(rounds, after)` amortises that, as
Cascade's set phase (arXiv 2506.20675) holds K = 0 for a while before measuring again: once the policy chooses a
round that drafts nothing (K = 0), the request's next `rounds` rounds decode plainly, neither probed nor asked.

    after = "plain"      every choice of K = 0 starts a hold
    after = "declined"   only a K = 0 chosen although this round's probe proposed a draft (a confidence > 0): where
                         the probe found nothing the policy was not really asked (FrozenPolicy.plain_index)

`rounds = 0` never holds. The engine's session (Session, a policy with `hold`), the environments (their `hold`
argument: a held step runs the held rounds too) and the evaluation apply the same rule, so a policy decides the same
everywhere; held rounds have no probe and no `policy_seconds`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.runtime.observation import KMAX

AFTER = ("plain", "declined")


@dataclass(frozen=True)
class Hold:
    rounds: int = 0
    after: str = "plain"

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise ValueError(f"hold rounds must be an integer >= 0, got {self.rounds!r}")
        if self.after not in AFTER:
            raise ValueError(f"hold after must be one of {AFTER}, got {self.after!r}")

    def __bool__(self) -> bool:
        return self.rounds > 0

    def held(self, depth: int, probe: Sequence[float]) -> int:
        """How many rounds to hold after a round of `depth` chosen with this round's probe values `probe`
        (confidences per depth first: engine.runtime.observation.probe_values; [] without a probe): `rounds` when
        the choice starts a hold (module docstring), else 0."""
        if self.rounds <= 0 or depth > 0:
            return 0
        if self.after == "declined" and not any(c > 0 for c in probe[:KMAX]):
            return 0
        return self.rounds

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "after": self.after}

    @classmethod
    def of(cls, value: Hold | Mapping[str, Any] | None) -> Hold:
        """A Hold from itself, its `to_dict()` (a frozen policy's card entry) or None (never holds); a clear
        ValueError for anything else."""
        if value is None:
            return cls()
        if isinstance(value, Hold):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"rounds", "after"})
            if unknown:
                raise ValueError(f"hold: unknown fields {unknown}; a hold has 'rounds' and 'after'")
            return cls(**value)
        raise ValueError(f"hold must be a Hold, a dict of its fields or None, got {type(value).__name__}")


NO_HOLD = Hold()
