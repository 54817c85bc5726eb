"""vLLM's two dynamic speculative decoding rules, re-implemented: a batch-size table and a goodput chooser.

1. Batch-size table (`VLLMTablePolicy`): `--speculative-config` field `num_speculative_tokens_per_batch_size`,
   a list of [start_bs, end_bs, optimal_K] entries; K = 0 means no drafts. Source: vllm-project/vllm,
   vllm/v1/spec_decode/dynamic/utils.py @ 14b450ca (`validate_and_normalize_dynamic_sd_schedule`,
   `build_dynamic_sd_schedule_lookup`) and docs/features/speculative_decoding/dynamic_speculative_decoding.md.
   Ranges must be positive, sorted and non-overlapping and start at 1; a batch size in a gap between
   ranges, or above the last one, takes the K of the range before it; K = min(K, num_speculative_tokens).
   The 5-item (bs x context length) form of the same file is not reproduced (ValueError).

2. Goodput chooser (`VLLMGoodputPolicy`): vllm/v1/spec_decode/dynamic/manager.py @ 594dc0f8,
   `DynamicSpeculativeDecodingManager` (`_compute_optimal_num_speculative_tokens`, `_get_batch_stats`,
   `_get_itl`, `step`, `compute_acceptance_rate_per_pos`):

       K* = argmax_K (1 + Σ_{i<K} acceptance_rate_per_pos[i]) / ITL(bs, K)      (first maximum wins)

   ITL comes from profiled `batch_stats` {bs: {K: ITL}}, linearly interpolated between the nearest
   profiled batch sizes and between profiled K. `acceptance_rate_per_pos[i]` = accepted / drafted tokens
   at position i (unconditional: position i counts as accepted only if all before it were); it starts from
   the configured prior and, after `warmup_steps` = 10 steps, is recomputed every step from the counts of
   all steps so far (0 for a position never drafted — as in vLLM, a position the chooser stops drafting
   stops earning acceptance). The counts are engine-wide, so `reset()` keeps them.

Mapping to expertspec: a vLLM step is one `act` (one request's round); positions are depths; the draft is a
chain (W = 1). Deviations, both to keep actions valid: a batch size above the largest profiled one uses
the largest (vLLM asserts instead), and the argmax runs over K <= num_speculative_tokens (vLLM runs it to
max_num_speculative_tokens = len(acceptance_rate_per_pos); the same when they are equal, the default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ctrl.policies.base import check_float, check_int, check_lam, make_spec
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation


def _check_schedule(table: object) -> list[tuple[int, int, int]]:
    """`validate_and_normalize_dynamic_sd_schedule` for 3-item entries, as ValueErrors."""
    if isinstance(table, (str, bytes)) or not isinstance(table, Sequence) or len(table) == 0:
        raise ValueError(f"table must be a non-empty list of [start_bs, end_bs, K] entries, got {table!r}")
    entries = []
    for i, e in enumerate(table):
        if isinstance(e, (str, bytes)) or not isinstance(e, Sequence) or len(e) != 3:
            raise ValueError(
                f"table[{i}] must be [start_bs, end_bs, K] (the 5-item context form is not supported), got {e!r}"
            )
        lo = check_int(f"table[{i}] start_bs", e[0], 1)
        hi = check_int(f"table[{i}] end_bs", e[1], lo)
        k = check_int(f"table[{i}] K", e[2], 0, KMAX)
        entries.append((lo, hi, k))
    entries.sort()
    prev_end = 0
    for lo, hi, _ in entries:
        if lo <= prev_end:
            raise ValueError("table batch-size ranges must be non-overlapping")
        prev_end = hi
    if entries[0][0] != 1:
        raise ValueError("the first table range must start at batch size 1")
    return entries


def table_depth(entries: Sequence[tuple[int, int, int]], batch_size: int, cap: int) -> int:
    """K of `batch_size` in a normalised schedule (the dense lookup of `build_dynamic_sd_schedule_lookup`)."""
    k = entries[0][2]
    for lo, hi, kk in entries:
        if batch_size < lo:
            break  # in a gap: the range before it
        k = kk
        if batch_size <= hi:
            break
    return min(cap, k)


class VLLMTablePolicy:
    """vLLM `num_speculative_tokens_per_batch_size`: K from a batch-size table (utils.py @ 14b450ca)."""

    name = "vllm-table"

    def __init__(
        self,
        table: Sequence[Sequence[int]],
        num_speculative_tokens: int | None = None,
        lam: float = 0.0,
    ) -> None:
        self.entries = _check_schedule(table)
        top = max(k for _, _, k in self.entries)
        if num_speculative_tokens is None:
            num_speculative_tokens = max(top, 1)
        self.num_speculative_tokens = check_int("num_speculative_tokens", num_speculative_tokens, 1, KMAX)
        if top > self.num_speculative_tokens:  # the docs: every optimal_K <= num_speculative_tokens
            raise ValueError(f"table K {top} exceeds num_speculative_tokens {self.num_speculative_tokens}")
        self.lam = check_lam(lam)

    def reset(self) -> None:
        pass

    def act(self, obs: Observation) -> SpecConfig:
        k = table_depth(self.entries, max(int(obs.batch_size), 1), self.num_speculative_tokens)
        return make_spec(k, 1, self.lam)


class VLLMGoodputPolicy:
    """vLLM `DynamicSpeculativeDecodingManager` (manager.py @ 594dc0f8): K maximising AL / ITL(bs, K)."""

    shared = True  # state is kept across requests (see the docstring); as_callable does not copy it

    name = "vllm-goodput"

    def __init__(
        self,
        batch_stats: Mapping[int, Mapping[int, float]],
        acceptance_rate_per_pos: Sequence[float],
        num_speculative_tokens: int | None = None,
        warmup_steps: int = 10,
        lam: float = 0.0,
    ) -> None:
        if isinstance(acceptance_rate_per_pos, (str, bytes)) or not isinstance(acceptance_rate_per_pos, Sequence):
            raise ValueError("acceptance_rate_per_pos must be a sequence of probabilities, one per draft position")
        prior = [
            check_float(f"acceptance_rate_per_pos[{i}]", a, 0.0, 1.0) for i, a in enumerate(acceptance_rate_per_pos)
        ]
        self.max_num_speculative_tokens = check_int("len(acceptance_rate_per_pos)", len(prior), 1, KMAX)
        if num_speculative_tokens is None:
            num_speculative_tokens = self.max_num_speculative_tokens
        self.num_speculative_tokens = check_int(
            "num_speculative_tokens", num_speculative_tokens, 1, self.max_num_speculative_tokens
        )
        self.batch_stats = self._check_stats(batch_stats)
        self.batch_sizes = sorted(self.batch_stats)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.lam = check_lam(lam)
        self.prior = tuple(prior)
        self.acceptance_rate_per_pos = list(prior)
        self.steps = 0
        self.num_draft_tokens_per_pos = [0] * self.num_speculative_tokens
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens
        self._pending = False

    def _check_stats(self, batch_stats: object) -> dict[int, dict[int, float]]:
        """The asserts of `DynamicSpeculativeDecodingManager.__init__`, plus coverage of K <= max (as ValueErrors)."""
        if not isinstance(batch_stats, Mapping) or not batch_stats:
            raise ValueError("batch_stats must be a non-empty mapping {batch_size: {K: ITL}}")
        out: dict[int, dict[int, float]] = {}
        for bs, row in batch_stats.items():
            bs = check_int("batch_stats batch size", bs, 1)
            if not isinstance(row, Mapping):
                raise ValueError(f"batch_stats[{bs}] must map K to an ITL, got {row!r}")
            itls: dict[int, float] = {}
            for k, t in row.items():
                itls[check_int(f"batch_stats[{bs}] K", k, 0)] = check_float(
                    f"batch_stats[{bs}][{k}]", t, 0.0, lo_open=True
                )
            out[bs] = dict(sorted(itls.items()))
            if 0 not in itls or 1 not in itls:
                raise ValueError(f"batch_stats[{bs}] must have ITLs for K = 0 and K = 1")
            if max(itls) < self.num_speculative_tokens:
                raise ValueError(f"batch_stats[{bs}] must reach K = {self.num_speculative_tokens} to interpolate ITL")
        if 1 not in out:
            raise ValueError("batch_stats must include batch size 1")
        keys = {tuple(row) for row in out.values()}
        if len(keys) != 1:  # vLLM interpolates between batch sizes K by K
            raise ValueError(f"every batch_stats row must profile the same K values, got {sorted(keys)}")
        return out

    def reset(self) -> None:
        self._pending = False

    def stats_for(self, batch_size: int) -> dict[int, float]:
        """`_get_batch_stats`: profiled row, or linear interpolation between the nearest profiled batch sizes."""
        bs = min(max(batch_size, 1), self.batch_sizes[-1])
        if bs in self.batch_stats:
            return self.batch_stats[bs]
        lo = max(b for b in self.batch_sizes if b < bs)
        hi = min(b for b in self.batch_sizes if b > bs)
        r = (bs - lo) / (hi - lo)
        a, b = self.batch_stats[lo], self.batch_stats[hi]
        return {k: a[k] + r * (b[k] - a[k]) for k in a}

    @staticmethod
    def itl(stats: Mapping[int, float], k: int) -> float:
        """`_get_itl`: profiled ITL at K drafts, or linear interpolation between the nearest profiled K."""
        if k in stats:
            return stats[k]
        lo = max(j for j in stats if j < k)
        hi = min(j for j in stats if j > k)
        return stats[lo] + (k - lo) / (hi - lo) * (stats[hi] - stats[lo])

    def optimal_k(self, batch_size: int) -> int:
        """`_compute_optimal_num_speculative_tokens`: first K maximising (1 + Σ_{i<K} a_i) / ITL(bs, K)."""
        stats = self.stats_for(batch_size)
        best_k, best = 0, -1.0
        for k in range(self.num_speculative_tokens + 1):
            goodput = (1.0 + sum(self.acceptance_rate_per_pos[:k])) / self.itl(stats, k)
            if goodput > best:
                best_k, best = k, goodput
        return best_k

    def act(self, obs: Observation) -> SpecConfig:
        if self._pending and obs.round_index > 0:  # the previous round's per-position counts
            drafted = min(max(int(obs.depth_last), 0), self.num_speculative_tokens)
            accepted = min(max(int(obs.accepted_last), 0), drafted)
            for i in range(drafted):
                self.num_draft_tokens_per_pos[i] += 1
                self.num_accepted_tokens_per_pos[i] += int(i < accepted)
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.acceptance_rate_per_pos = [
                a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)
            ]
        self._pending = True
        return make_spec(self.optimal_k(obs.batch_size), 1, self.lam)
