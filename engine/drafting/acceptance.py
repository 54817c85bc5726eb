"""Calibrated node acceptance for the "calibrated" verification rule: P(node accepted | parent accepted).

A node's estimate depends on three draft-time features: its depth d, the drafter's conditional probability
of it (`cond` = path_prob / parent's path_prob; the coupled score in position mode) and whether a second,
free drafter agrees with it: the prompt-lookup continuation (engine.drafting.suffix.suffix_continuations)
of the committed tokens followed by the node's path. Agreement of two drafters is a strong acceptance
signal where the drafter's own probability is flat: on the zoo pair an EAGLE draft that the n-gram
continuation confirms is accepted 81-96 % of the time, one it contradicts 7-19 % (held-out nodes).
Stopping a draft by predicted acceptance follows SpecDec++ (arXiv 2405.19715) and DISCO (2405.04304); the
second drafter is prompt lookup, the suffix matching SuffixDecoding (2411.04975) also builds on.

    state  NONE (0)      no suffix of the context recurs: the n-gram drafter has nothing to say
           AGREE (1)     its next token is the node's token
           DISAGREE (2)  its next token is another one

Per state, an isotonic map per depth (engine.spec.calibration.IsotonicCalibration) of `cond` -> P. The
calibrated path probability of a node is the product of these along its path (non-increasing with depth,
so the set of nodes above a threshold is prefix-closed). It is fitted on recorded traces by
`env.calibration.fit_acceptance`; here it is plain data the engine, the environments and a frozen policy
share.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from engine.drafting.suffix import SuffixIndex
from engine.spec.calibration import IsotonicCalibration

NONE, AGREE, DISAGREE = 0, 1, 2
STATES = ("none", "agree", "disagree")
MAX_NGRAM = 4  # the n-gram drafter's default


def agreement_state(predicted: int | None, token: int) -> int:
    """NONE / AGREE / DISAGREE of the prompt-lookup prediction `predicted` (None: no match) with `token`."""
    if predicted is None:
        return NONE
    return AGREE if predicted == int(token) else DISAGREE


def agreement(context: Sequence[int], token: int, max_ngram: int = MAX_NGRAM) -> int:
    """agreement_state of the prompt-lookup next token of `context` (committed tokens + the node's path to its
    parent; engine.drafting.suffix.suffix_continuations) with `token`."""
    return agreement_state(SuffixIndex(list(context)).next_token([], max_ngram), token)


@dataclass(frozen=True)
class AcceptanceModel:
    """Callable (cond, depth 1.., state) -> P(node accepted | parent accepted); plain data, JSON-able."""

    maps: tuple[IsotonicCalibration, IsotonicCalibration, IsotonicCalibration]  # per state NONE, AGREE, DISAGREE
    max_ngram: int = MAX_NGRAM

    def __call__(self, cond: float, depth: int, state: int) -> float:
        return self.maps[state](cond, depth)

    def node(self, index: SuffixIndex, path: list[int], token: int, cond: float, depth: int) -> float:
        """P(accepted | parent accepted) of a node below `path` (its parent's tokens from depth 1) over the
        committed tokens of `index` (SuffixIndex(committed tokens), built once per round)."""
        return self(cond, depth, agreement_state(index.next_token(path, self.max_ngram), token))

    def tree(
        self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int], cond: Sequence[float]
    ) -> list[float]:
        """Calibrated path probabilities [N] of a tree in node order (parents first; node 0 = root, whose last
        token is context[-1]): Π over the path of `node`. `cond` [N] conditional draft probabilities."""
        index = SuffixIndex(list(context))
        paths: list[list[int]] = [[]]
        out = [1.0]
        depth = [0]
        for j in range(1, len(tokens)):
            p = int(parents[j])
            paths.append(paths[p] + [int(tokens[j])])
            depth.append(depth[p] + 1)
            out.append(out[p] * self.node(index, paths[p], int(tokens[j]), float(cond[j]), depth[j]))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "acceptance", "max_ngram": self.max_ngram, "states": {
            name: m.to_dict() for name, m in zip(STATES, self.maps)}}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceModel:
        if d.get("kind") != "acceptance" or set(d.get("states", {})) != set(STATES):
            raise ValueError(f"not an acceptance model (kind 'acceptance' with states {STATES}): {str(d)[:120]}")
        maps = tuple(IsotonicCalibration.from_dict(d["states"][name]) for name in STATES)
        return cls(maps, int(d.get("max_ngram", MAX_NGRAM)))  # type: ignore[arg-type]

    @cached_property
    def digest(self) -> str:
        """16 hex digits naming this model (replay tables built with it are cached under it)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
