"""What is reported per policy × workload (DESIGN.md §5), computed from per-request round records.

A round record is anything with RoundStats' fields `committed`, `cost` (T_spec), `cost_ar` (T_AR of the
same cost source at that position), `distinct_experts` ([L] U_l), `attempted_by_depth`, `accepted_by_depth`
— the live engine's RoundStats and the replay environment's records alike.

    committed_per_cost            Σ committed / Σ T_spec                     (tokens per second of target cost)
    speedup_vs_ar                 Σ committed / Σ (T_spec / T_AR)            (= plain-decode time / our time)
    committed_per_expert_execution Σ committed / Σ_rounds Σ_l U_l           (tokens per expert weight read)
    tau                           mean committed per round
    p50/p95/p99_tpot              per-request T_spec per committed token, percentiles over requests
    frac_requests_slowed          share of requests whose own speed-up is < 1 (slower than plain decoding)
    request_speedups              each request's own speed-up (`request_speedup`), in the order given
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class Summary:
    committed_per_cost: float
    speedup_vs_ar: float
    committed_per_expert_execution: float
    tau: float
    mean_distinct_experts: float
    p50_tpot: float
    p95_tpot: float
    p99_tpot: float
    frac_requests_slowed: float
    requests: int
    rounds: int
    committed: int
    acceptance_by_depth: list[float]
    request_speedups: list[float]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_speedup(rounds: Sequence[Any]) -> float:
    """Plain-decode time of the request's committed tokens / its time under the policy."""
    spent = sum(float(r.cost) / float(r.cost_ar) for r in rounds)
    return sum(int(r.committed) for r in rounds) / spent if spent > 0 else 1.0


def summarize(requests: Sequence[Sequence[Any]]) -> Summary:
    """requests: one list of round records per request (all under one cost model)."""
    rounds = [r for req in requests for r in req]
    if not rounds:
        raise ValueError("no rounds to summarise")
    committed = sum(int(r.committed) for r in rounds)
    cost = sum(float(r.cost) for r in rounds)
    ar_units = sum(float(r.cost) / float(r.cost_ar) for r in rounds)
    experts = sum(sum(r.distinct_experts) for r in rounds)
    per_layer = [np.mean(r.distinct_experts) for r in rounds if len(r.distinct_experts)]
    tpot = [sum(float(r.cost) for r in req) / max(sum(int(r.committed) for r in req), 1) for req in requests if req]
    speedups = [request_speedup(req) for req in requests if req]
    K = max((len(r.attempted_by_depth) for r in rounds), default=0)
    tried, ok = np.zeros(K), np.zeros(K)
    for r in rounds:
        n = len(r.attempted_by_depth)
        tried[:n] += np.asarray(r.attempted_by_depth, dtype=float)
        ok[:n] += np.asarray(r.accepted_by_depth, dtype=float)
    return Summary(
        committed_per_cost=committed / cost if cost > 0 else 0.0,
        speedup_vs_ar=committed / ar_units if ar_units > 0 else 0.0,
        committed_per_expert_execution=committed / experts if experts > 0 else 0.0,
        tau=committed / len(rounds),
        mean_distinct_experts=float(np.mean(per_layer)) if per_layer else 0.0,
        p50_tpot=float(np.percentile(tpot, 50)),
        p95_tpot=float(np.percentile(tpot, 95)),
        p99_tpot=float(np.percentile(tpot, 99)),
        frac_requests_slowed=float(np.mean([s < 1.0 - 1e-9 for s in speedups])),
        requests=len([q for q in requests if q]),
        rounds=len(rounds),
        committed=committed,
        acceptance_by_depth=[float(o / t) if t else float("nan") for o, t in zip(ok, tried)],
        request_speedups=[float(x) for x in speedups],
    )
