"""Per-round records and request results: what the engine returns instead of printing.

`RoundStats` is the raw material of the environment's observation (DESIGN.md §3) and of every
reported metric (§5). Shape letters: L=MoE layers E=experts n=verified tokens r=top-r.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RoundStats:
    """One draft -> verify -> commit cycle of one request.

    Times are seconds of the whole batched step this request took part in (a batched forward has one
    cost); `draft_seconds` is this request's drafting time.
    """

    round_index: int
    depth: int  # K requested by this round's action (0 = plain decode)
    width: int  # W
    lam: float  # λ
    verified_tokens: int  # n: root + verified draft nodes
    proposed: int  # drafted nodes sent to verification (n - 1)
    accepted: int  # drafted nodes kept (longest accepted path)
    committed: int  # accepted + 1 (recovered or bonus), fewer if the request ended inside the block
    bonus: bool = False
    rejection_depth: int | None = None  # depth of the first rejected level; None if bonus / K=0
    built_depth: int = 0  # depth of the tree actually drafted (<= depth: end of request, no match, threshold)
    attempted_by_depth: list[int] = field(default_factory=list)  # [built_depth] 1 if depth d was tried
    accepted_by_depth: list[int] = field(default_factory=list)  # [built_depth] 1 if depth d was accepted
    draft_confidence: list[float] = field(default_factory=list)  # [built_depth] drafter prob of the best node
    verify_rule: str = "all"  # the action's verification rule (SpecConfig.verify_rule)
    new_pairs_per_node: float | None = None  # (layer, expert) pairs beyond the root's, per drafted node
    # routing footprint of the verification forward (empty for dense targets / instrumentation off)
    distinct_experts: list[int] = field(default_factory=list)  # [L] U_l
    tokens_per_expert: torch.Tensor | None = None  # [L, E] assignment counts
    reuse: float = 0.0  # 1 - sum_l U_l / sum_l (n * r)
    overlap_prev: float | None = None  # share of this round's (layer, expert) pairs used last round
    rank_imbalance_mean: float | None = None  # virtual / real EP layout, max/mean per layer
    rank_imbalance_max: float | None = None
    cross_node_ratio: float | None = None
    time: dict[str, float] = field(default_factory=dict)  # draft, forward, sampling (verification and commit after the
    # forward, a part of host_seconds) (+ attention, router, ... when timed)
    round_seconds: float = 0.0  # measured cost of the round: forward + this request's drafting + probe + host_seconds
    probe_seconds: float = 0.0  # the drafter's probe before the choice (Session.probe; 0: none)
    host_seconds: float = 0.0  # the step's host work: its wall time from the session's step call on (Session.step;
    # Engine._step when called alone) but the actions' choice, the drafting and the target's forward — tree packing,
    # acceptance, KV commit / rollback, the drafter's state update, bookkeeping (T_book of DESIGN §3)
    policy_seconds: float = 0.0  # choosing this round's action (observation + policy call; 0 without a policy)
    modelled_seconds: float | None = None  # roofline cost, when a cost model is attached
    offload: Any = None  # engine.offload.cache.OffloadStats of the batched step (Engine(offload=...)); not imported:
    # offload sits above runtime
    batch_size: int = 1  # requests verified in the same forward
    context_len: int = 0  # tokens in the target cache before the round (committed tokens but the root)
    cost: float | None = None  # T_spec under the engine's round_cost (None: use round_seconds)
    cost_ar: float | None = None  # T_AR (one target-only step) under the same cost source

    @property
    def mean_distinct_experts(self) -> float:
        return sum(self.distinct_experts) / len(self.distinct_experts) if self.distinct_experts else 0.0


@dataclass
class GenerationResult:
    """Output of one request: new tokens only, plus its rounds."""

    token_ids: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    finish_reason: str = "length"  # "length" | "eos"
    prompt_len: int = 0

    @property
    def acceptance_length(self) -> float:
        """τ: mean committed tokens per round (1.0 for plain decoding)."""
        return sum(r.committed for r in self.rounds) / max(len(self.rounds), 1)
