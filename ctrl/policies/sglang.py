"""SGLang's adaptive speculative decoding rule (`--speculative-adaptive`), re-implemented.

Source: sgl-project/sglang, python/sglang/srt/speculative/adaptive_spec_params.py at commit 015c8726
(`DEFAULT_ADAPTIVE_CONFIG`, `_load_adaptive_config`, `AdaptiveStepSlot.update` / `_recompute_params`,
`AdaptiveSpeculativeParams.get_steps_for_batch` / `on_verify_complete`), with batch-size routing from
adaptive_step_router.py (`AdaptiveStepRouter.batch_size_key_for_batch`) and the step -> draft-token map
from adaptive_runtime_state.py (`AdaptiveController.init_states`: num_draft_tokens = steps + 1, topk = 1).

The rule ("ema" strategy, the default). The config maps batch-size lower bounds to slots; a batch of size
b uses the slot of the largest key <= b (the smallest key below all; with CUDA graphs b is first padded up
to the next captured size). Each slot keeps an EMA of accepted drafts per request,

    ema <- (1 - α) · ema + α · mean(accepted drafts of the batch)      (only while the slot's steps > 0)

initialised at steps - 1, and picks its num_steps among sorted `candidate_steps`. After `warmup_batches`
verifies, every `update_interval`-th verify recomputes: from steps 0 probe the next candidate; otherwise move
down one candidate while ema <= prev - 0.5 + down_hysteresis (0.5 + down_hysteresis when prev = 0), else
up while ema > current - 0.5 + up_hysteresis; `ceiling_coeff` > 0 caps a non-increasing target at
max(1, ceil(ema · ceiling_coeff)). Defaults: α = 0.2, update_interval = 5, warmup_batches = 10.
The initial steps are `initial_steps` (SGLang's --speculative-num-steps) if a candidate, else the middle one.

Mapping to expertspec: num_steps = depth K, topk = 1 = width W (SGLang's adaptive mode supports only
EAGLE chains). One `act` is one verify of a one-request batch: the previous round's `accepted_last` is fed
to the slot that chose that round's K (in SGLang the same slot picks and is fed within a batch), then the
slot of `obs.batch_size` picks the next K. SGLang's state is server-wide, so by default `reset()` keeps it;
`reset_per_request=True` starts each request from the initial slots. The "throughput_aware" strategy of the
same file (profiled timings) is not reproduced.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

from ctrl.policies.base import check_bool, check_float, check_int, check_lam, make_spec
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation

# DEFAULT_ADAPTIVE_CONFIG of adaptive_spec_params.py @ 015c8726 (other stored revisions have [1, 3, 7] at BS 1).
DEFAULT_ADAPTIVE_CONFIG: dict[str, dict] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
SLOT_KNOBS = ("ema_alpha", "update_interval", "warmup_batches", "down_hysteresis", "up_hysteresis", "ceiling_coeff")


class StepSlot:
    """One batch-size slot: `AdaptiveStepSlot` of adaptive_spec_params.py."""

    def __init__(self, initial_steps: int, cfg: Mapping, where: str) -> None:
        steps = cfg.get("candidate_steps")
        if (
            not isinstance(steps, list)
            or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= KMAX for s in steps)
        ):
            raise ValueError(f"{where}: candidate_steps must be a non-empty list of ints in 0..{KMAX}, got {steps!r}")
        self.candidate_steps = sorted(set(steps))
        self.ema_alpha = check_float(f"{where} ema_alpha", cfg.get("ema_alpha", 0.2), 0.0, 1.0)
        self.update_interval = check_int(f"{where} update_interval", cfg.get("update_interval", 5), 1)
        self.warmup_batches = check_int(f"{where} warmup_batches", cfg.get("warmup_batches", 10), 0)
        self.down_hysteresis = check_float(f"{where} down_hysteresis", cfg.get("down_hysteresis", -0.25), -math.inf)
        self.up_hysteresis = check_float(f"{where} up_hysteresis", cfg.get("up_hysteresis", 0.0), -math.inf)
        self.ceiling_coeff = check_float(f"{where} ceiling_coeff", cfg.get("ceiling_coeff", 0), 0.0)
        if initial_steps in self.candidate_steps:
            self.current_steps = initial_steps
        else:
            self.current_steps = self.candidate_steps[len(self.candidate_steps) // 2]
        self.ema_accept_len = float(self.current_steps - 1)  # neutral start
        self.batch_count = 0

    def update(self, num_correct_drafts_per_req: Sequence[int]) -> bool:
        """Feed one verify's accepted drafts per request; True if the steps changed."""
        if not num_correct_drafts_per_req:
            return False
        if self.current_steps > 0:
            batch_avg = sum(num_correct_drafts_per_req) / len(num_correct_drafts_per_req)
            self.ema_accept_len = (1 - self.ema_alpha) * self.ema_accept_len + self.ema_alpha * batch_avg
        self.batch_count += 1
        if self.batch_count <= self.warmup_batches:
            return False
        if (self.batch_count - self.warmup_batches) % self.update_interval != 0:
            return False
        return self._recompute()

    def _recompute(self) -> bool:
        cands, old = self.candidate_steps, self.current_steps
        idx = old_idx = cands.index(old)
        if old == 0:  # probe the smallest positive step after a no-speculation interval
            idx = min(idx + 1, len(cands) - 1)
            target = cands[idx]
            if target > 0 and self.ema_accept_len < 0:
                self.ema_accept_len = float(target - 1)
            return self._apply(target)
        while idx > 0:
            prev = cands[idx - 1]
            drop = (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis
            if self.ema_accept_len <= drop:
                idx -= 1
            else:
                break
        if idx == old_idx:
            while idx < len(cands) - 1 and self.ema_accept_len > cands[idx] - 0.5 + self.up_hysteresis:
                idx += 1
        target = cands[idx]
        if self.ceiling_coeff > 0:  # caps only a non-increasing target
            ceiling = max(1, math.ceil(self.ema_accept_len * self.ceiling_coeff))
            if ceiling < target <= old:
                while idx > 0 and cands[idx] > ceiling:
                    idx -= 1
                target = cands[idx]
        return self._apply(target)

    def _apply(self, target: int) -> bool:
        changed = target != self.current_steps
        self.current_steps = target
        return changed


class SGLangAdaptivePolicy:
    """SGLang `--speculative-adaptive` (EMA strategy) as a policy; see the module docstring for the source."""

    shared = True  # state is kept across requests (see the docstring); as_callable does not copy it

    name = "sglang-adaptive"

    def __init__(
        self,
        config: Mapping | None = None,
        initial_steps: int = 3,
        cuda_graph_bs: Sequence[int] | None = None,
        lam: float = 0.0,
        reset_per_request: bool = False,
    ) -> None:
        cfg = DEFAULT_ADAPTIVE_CONFIG if config is None else config
        if not isinstance(cfg, Mapping):
            raise ValueError(f"config must be a mapping like SGLang's adaptive JSON, got {type(cfg).__name__}")
        self.initial_steps = check_int("initial_steps", initial_steps, 0, KMAX)
        globals_ = {k: v for k, v in cfg.items() if not str(k).isdigit()}
        unknown = set(globals_) - set(SLOT_KNOBS) - {"strategy"}
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; allowed: BS keys and {SLOT_KNOBS}")
        if globals_.get("strategy", "ema") != "ema":
            raise ValueError(f"config strategy {globals_['strategy']!r}: only SGLang's 'ema' strategy is reproduced")
        self._entries: dict[int, dict] = {}
        for key, entry in cfg.items():
            if not str(key).isdigit():
                continue
            if not isinstance(entry, Mapping):
                raise ValueError(f"config[{key!r}] must be a mapping with candidate_steps, got {entry!r}")
            bad = set(entry) - set(SLOT_KNOBS) - {"candidate_steps"}
            if bad:
                raise ValueError(f"config[{key!r}]: unknown keys {sorted(bad)}; allowed: candidate_steps, {SLOT_KNOBS}")
            self._entries[int(key)] = {**globals_, **entry}
        if not self._entries or min(self._entries) < 1:
            raise ValueError('config needs integer batch-size keys >= 1, e.g. {"1": {"candidate_steps": [1, 3, 7]}}')
        if cuda_graph_bs is not None:
            cuda_graph_bs = sorted(check_int("cuda_graph_bs entry", b, 1) for b in cuda_graph_bs) or None
        self.cuda_graph_bs = cuda_graph_bs
        self.bs_keys = sorted(self._entries)
        self.lam = check_lam(lam)
        self.reset_per_request = check_bool("reset_per_request", reset_per_request)
        self._build_slots()

    def _build_slots(self) -> None:
        self.slots = {bs: StepSlot(self.initial_steps, e, f"config[{bs}]") for bs, e in self._entries.items()}
        self._last: int | None = None

    def reset(self) -> None:
        if self.reset_per_request:
            self._build_slots()
        self._last = None

    def slot_key(self, batch_size: int) -> int:
        """`AdaptiveStepRouter.batch_size_key_for_batch`: pad to a CUDA-graph size, take the largest key <= it."""
        if self.cuda_graph_bs is not None:
            i = bisect.bisect_left(self.cuda_graph_bs, batch_size)
            if i < len(self.cuda_graph_bs):
                batch_size = self.cuda_graph_bs[i]
        return self.bs_keys[max(0, bisect.bisect_right(self.bs_keys, batch_size) - 1)]

    def act(self, obs: Observation) -> SpecConfig:
        if self._last is not None and obs.round_index > 0:
            self.slots[self._last].update([max(int(obs.accepted_last), 0)])
        self._last = self.slot_key(obs.batch_size)
        return make_spec(self.slots[self._last].current_steps, 1, self.lam)
