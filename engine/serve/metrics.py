"""Prometheus metrics of the server (`/metrics`), named like vLLM's where they overlap.

Every metric lives in the server's own `CollectorRegistry` (two servers in one process, as in the tests,
never collide). Prefix `expertspec:` with vLLM's suffixes:

    vLLM                                          here
    vllm:num_requests_running / _waiting          expertspec:num_requests_running / _waiting
    vllm:kv_cache_usage_perc                      expertspec:kv_cache_usage_perc (+ kv_blocks_in_use)
    vllm:time_to_first_token_seconds              expertspec:time_to_first_token_seconds
    vllm:request_time_per_output_token_seconds    expertspec:request_time_per_output_token_seconds
    vllm:inter_token_latency_seconds              expertspec:inter_token_latency_seconds (per round)
    vllm:e2e_request_latency_seconds              expertspec:e2e_request_latency_seconds
    vllm:request_success_total{finished_reason}   expertspec:request_success_total{finished_reason}
    vllm:prompt_tokens_total / generation_...     expertspec:prompt_tokens_total / generation_tokens_total
    vllm:spec_decode_num_drafts_total             expertspec:spec_decode_num_drafts_total
    vllm:spec_decode_num_draft_tokens_total       expertspec:spec_decode_num_draft_tokens_total
    vllm:spec_decode_num_accepted_tokens_total    expertspec:spec_decode_num_accepted_tokens_total
    vllm:spec_decode_num_accepted_tokens_per_pos  expertspec:spec_decode_num_accepted_tokens_per_pos{position}

Ours only: spec_rounds_total, spec_committed_tokens_total, request_tau (committed tokens per round),
request_utility (per request Σ R / Σ T_spec/T_AR: committed tokens per target cost in target-only steps, i.e.
the request's speed-up over plain decoding under the cost model; DESIGN §1), spec_round_cost_seconds_total and
spec_round_cost_ar_steps_total (Σ T_spec in modelled seconds and in T_AR units: committed tokens per target
cost of the whole run = spec_committed_tokens_total / either), distinct_experts_per_layer (per verification),
policy_depth / policy_width / policy_lambda (the chosen K / W / λ per round), request_errors_total{code},
requests_rejected_total{reason}. The cost model is the scheduler's `round_cost` (engine.cost.round_cost).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "expertspec:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """All server metrics over one registry; `render()` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(P + "num_requests_running", "Requests in the engine session", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests queued for KV capacity", registry=r)
        self.kv_blocks = Gauge(P + "kv_blocks_in_use", "Target KV blocks held", registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Share of target KV blocks held (0..1)", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "TTFT", buckets=_LATENCY, registry=r)
        self.tpot = Histogram(P + "request_time_per_output_token_seconds", "TPOT", buckets=_LATENCY, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between rounds that commit tokens",
                             buckets=_LATENCY, registry=r)  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY, registry=r)
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.errors = Counter(P + "request_errors", "Requests failed with an error", ["code"], registry=r)
        self.rejected = Counter(P + "requests_rejected", "Requests refused at admission", ["reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Committed output tokens", registry=r)
        self.drafts = Counter(P + "spec_decode_num_drafts", "Rounds that drafted at least one token", registry=r)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.accepted_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by depth",
                                    ["position"], registry=r)  # fmt: skip
        self.rounds = Counter(P + "spec_rounds", "Draft-verify-commit rounds (one per request per step)", registry=r)
        self.committed = Counter(P + "spec_committed_tokens", "Committed tokens (accepted + recovered/bonus)",
                                 registry=r)  # fmt: skip
        self.tau = Histogram(P + "request_tau", "Committed tokens per round, per request",
                             buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8), registry=r)  # fmt: skip
        self.utility = Histogram(P + "request_utility", "Committed tokens per target cost (in T_AR) per request",
                                 buckets=(0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4), registry=r)  # fmt: skip
        self.cost_seconds = Counter(P + "spec_round_cost_seconds", "Σ T_spec of the rounds (modelled seconds)",
                                    registry=r)  # fmt: skip
        self.cost_ar_steps = Counter(P + "spec_round_cost_ar_steps", "Σ T_spec / T_AR of the rounds", registry=r)
        self.experts = Histogram(P + "distinct_experts_per_layer", "Mean distinct experts per MoE layer per "
                                 "verification", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)  # fmt: skip
        self.depth = Histogram(P + "policy_depth", "Chosen K per round", buckets=tuple(range(9)), registry=r)
        self.width = Histogram(P + "policy_width", "Chosen W per round", buckets=(1, 2, 3, 4, 6, 8), registry=r)
        self.lam = Histogram(P + "policy_lambda", "Chosen λ per round", buckets=(0, 0.1, 0.25, 0.5, 1, 2), registry=r)

    def observe_round(self, stats, cost: tuple[float, float] | None = None) -> None:
        """One request's RoundStats (engine.runtime.stats) of one step and its (T_spec, T_AR), if priced."""
        self.rounds.inc()
        if cost is not None:
            self.cost_seconds.inc(cost[0])
            self.cost_ar_steps.inc(cost[0] / cost[1])
        self.committed.inc(stats.committed)
        self.generation_tokens.inc(stats.committed)
        if stats.proposed > 0:
            self.drafts.inc()
            self.draft_tokens.inc(stats.proposed)
            self.accepted.inc(stats.accepted)
            for d, ok in enumerate(stats.accepted_by_depth):
                if ok:
                    self.accepted_pos.labels(position=str(d)).inc()
        if stats.distinct_experts:
            self.experts.observe(stats.mean_distinct_experts)
        self.depth.observe(stats.depth)
        self.width.observe(stats.width)
        self.lam.observe(stats.lam)

    def observe_finished(self, rounds: list, reason: str, utility: float | None = None) -> None:
        """A request that completed (engine rounds of it, OpenAI finish reason, its utility when priced)."""
        self.success.labels(finished_reason=reason).inc()
        if rounds:
            self.tau.observe(sum(s.committed for s in rounds) / len(rounds))
        if utility is not None:
            self.utility.observe(utility)

    def render(self) -> bytes:
        return generate_latest(self.registry)
