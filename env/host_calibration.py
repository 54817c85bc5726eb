"""Timed live rounds of the engine: the samples of the measured cost's host-work term (T_book).

A trace's replay prices drafting and verification from timed forwards (env.record); what a live round also
pays — packing the tree, acceptance, KV commit and rollback, the drafter's state update, the session's
bookkeeping — the recorder never runs. So while a trace records (calibrate_every > 0), each request is also
decoded live at batch 1: once by a target-only engine and once per static action of `host_actions` by an
engine with the recording's drafter, with the trace's own sampling; every round's RoundStats.host_seconds is a
sample (the trace's cal_live_* arrays), to which engine.cost.host_cost fits book(n) and the target-only step's
share of T_AR. The same rounds' forward and drafting seconds are samples too: the single-token forward (one fit to
both engines' rounds, the same code) and the drafting rounds are priced from them (env.costs.FittedCostModel), since
the recorder's own timings
run other code paths (a tree-attention forward of one token; drafting outside the engine's loop) and were measured
25 % dearer (T_AR) and 20–30 % cheaper (prompt-lookup drafting) than the live rounds. The actions span n = 1
(K = 0) to the grid's largest tree, under each way a rule scores the nodes as they grow (DRAFT_RULES). The K = 0
rounds run as a probing policy runs them: `Session.probe` of the deepest, widest tree first (the drafter's own probe,
the prompt lookup's, or for a drafter without one the context probe, engine.runtime.context_probe), its seconds a
sample of the probe's price (the recorder's own timing runs warm, right after its drafting: 10–11 µs against
15–18 µs in place, session 2026-12-06 f); then a learned controller's choice, by a stand-in of its shape
(engine.runtime.frozen.stand_in_policy: the learned actor's layers, RecordConf.policy_hidden, random weights, K = 0
whatever it observes), whose
RoundStats.policy_seconds are the samples of what a learned policy pays per round (cal_live_policy_seconds).
Since trace format 11 a last run decodes K = 0 again without the stand-in, as a rule or a static K = 0 runs it: the
single-token round's fit takes those rounds, and what the probe and the choice cost the round after them (its host
work and forward, slower with caches they cooled) is priced with the choice (env.costs.FittedCostModel).
Each round also records its run (cal_live_run: 0 the target-only engine, 1 + the index of its action in `host_actions`,
then 1 + len(host_actions) that bare K = 0 run)
and its index in its request (cal_live_round): the first rounds after a prefill are slower whatever they run, which the
fitted cost prices as a warm-up surcharge by round index (engine.cost.warmup) and leaves out of the other fits; and
the rounds of one run of one request are consecutive, so each round's predecessor is known: a round of the other kind
than the one before it (a tree after a draft cut to its root, or the reverse) costs more, which the fitted cost prices
as a switching surcharge (engine.cost.switching) and also leaves out of the other fits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.cost.drafter_cost import DRAFT_RULES
from engine.drafting.acceptance import AcceptanceModel
from engine.runtime.action_grid import ActionGrid
from engine.runtime.engine import Engine
from engine.runtime.frozen import STAND_IN_HIDDEN, stand_in_policy
from engine.spec.calibration import IsotonicCalibration
from engine.spec.config import SpecConfig
from engine.spec.sampling import SamplingParams
from env.costs import draft_rule, drafter_steps
from env.trace import ARRAYS

WARMUP_TOKENS = 4
LIVE_ARRAYS = {k: dtype for k, (dtype, _) in ARRAYS.items() if k.startswith("cal_live_")}  # one entry per timed round


SCORED_THRESHOLD = 0.1  # the grid's loosest threshold (raw), 0.05 its loosest calibrated one: deep trees still grow
CALIBRATED_THRESHOLD = 0.05


def neutral_acceptance(kmax: int) -> AcceptanceModel:
    """An acceptance model that passes the draft's own probability through (identity maps, knots per depth): what
    the calibrated rule costs to evaluate, before a model is fitted (that happens on the training prompts, after
    recording)."""
    identity = identity_calibration(kmax)
    return AcceptanceModel((identity, identity, identity))


def identity_calibration(kmax: int) -> IsotonicCalibration:
    """The isotonic map that changes nothing, two knots per depth 1..kmax."""
    return IsotonicCalibration(tuple((0.0, 1.0) for _ in range(kmax)), tuple((0.0, 1.0) for _ in range(kmax)))


def host_actions(kmax: int, widths: list[int]) -> list[SpecConfig]:
    """K = 0, and chains and trees up to the grid's deepest and widest — (2, 1), (⌈kmax/2⌉, max W), (kmax, 1),
    (kmax, max W) — under each drafting rule (DRAFT_RULES: verify everything; the raw threshold; the calibrated
    rule, with `neutral_acceptance`), λ = 0."""
    w = max(widths)
    shapes = list(dict.fromkeys([(min(2, kmax), 1), (-(-kmax // 2), w), (kmax, 1), (kmax, w)]))
    acceptance = neutral_acceptance(kmax)
    rules = [dict(verify_rule="all"), dict(verify_rule="threshold", verify_threshold=SCORED_THRESHOLD),
             dict(verify_rule="calibrated", verify_threshold=CALIBRATED_THRESHOLD, acceptance=acceptance)]  # fmt: skip
    return [SpecConfig(depth=0)] + [SpecConfig(depth=k, width=wd, **r) for r in rules for k, wd in shapes]


class HostCalibrator:
    """Times the host work of live rounds for one recording's models (module docstring)."""

    def __init__(self, target: Any, drafter: Any, kmax: int, widths: list[int], eos_token_id: int | None,
                 hidden: tuple[int, ...] = STAND_IN_HIDDEN) -> None:  # fmt: skip
        self.base = Engine(target, instrument=False)  # plain decoding as a deployment runs it: no routing records
        self.spec = Engine(target, drafter=drafter)  # a policy observes the footprint: instrumented, as deployed
        self.actions = host_actions(kmax, widths)
        self.kmax, self.width = kmax, max(widths)  # the probe's tree, as the recorder's (env.request_recorder)
        # the stand-in has the learned actor's hidden layers (`hidden`: RecordConf.policy_hidden)
        self.chooser = stand_in_policy(ActionGrid(depths=tuple(range(kmax + 1)), widths=tuple(widths)), hidden,
                                       probe=(kmax, max(widths)), calibration=identity_calibration(kmax))  # fmt: skip
        self.eos = eos_token_id
        self._warm = False

    def _generate(self, engine: Engine, prompt: list[int], tokens: int, params: SamplingParams, spec=None,
                  bare: bool = False):  # fmt: skip
        if spec is None or spec.depth > 0 or engine.drafter is None or bare:  # bare: K = 0 without a policy
            return engine.generate([prompt], tokens, sampling=params, spec=spec, eos_token_id=self.eos)[0]
        # K = 0 as a probing learned policy runs it: the probe (the drafter's or the context probe), then the choice
        return engine.generate([prompt], tokens, sampling=params, policy=self.chooser, eos_token_id=self.eos)[0]

    @staticmethod
    def empty() -> dict[str, np.ndarray]:
        """No samples (a recording without calibration)."""
        return {k: np.zeros(0, dtype=d) for k, d in LIVE_ARRAYS.items()}

    def run(self, prompt: list[int], max_new_tokens: int, params: SamplingParams) -> dict[str, np.ndarray]:
        """The cal_live_* arrays (LIVE_ARRAYS) of decoding `prompt` once per engine and action."""
        if not self._warm:  # first calls allocate the engines' caches and buffers: not a round's cost
            self._generate(self.base, prompt, WARMUP_TOKENS, params)
            for a in self.actions:
                self._generate(self.spec, prompt, WARMUP_TOKENS, params, a)
            self._generate(self.spec, prompt, WARMUP_TOKENS, params, self.actions[0], bare=True)
            self._warm = True
        out: dict[str, list] = {k: [] for k in LIVE_ARRAYS}
        # the last run: K = 0 again, without the stand-in's probe and choice (as a rule or a static K = 0 runs it)
        runs = [(self.base, None, False)] + [(self.spec, a, False) for a in self.actions]
        runs.append((self.spec, self.actions[0], True))
        for run, (engine, action, bare) in enumerate(runs):
            position = 0
            rule = DRAFT_RULES.index(draft_rule(action)) if action is not None else 0
            for i, r in enumerate(self._generate(engine, prompt, max_new_tokens, params, action, bare).rounds):
                remaining = max_new_tokens - position
                kd = min(action.depth, remaining - 1) if action is not None and remaining > 1 else 0
                steps = drafter_steps(kd, r.built_depth, action) if kd > 0 else 0
                row = {"verified": r.verified_tokens, "plain": action is None, "context": r.context_len,
                       "draft_steps": steps, "rule": rule, "width": r.width,
                       "draft_seconds": r.time["draft"] if steps > 0 else 0.0, "forward_seconds": r.time["forward"],
                       "host_seconds": r.host_seconds, "probe_seconds": r.probe_seconds,
                       "policy_seconds": r.policy_seconds, "run": run, "round": i}  # fmt: skip
                for k, v in row.items():
                    out[f"cal_live_{k}"].append(v)
                position += r.committed
        return {k: np.asarray(v, dtype=LIVE_ARRAYS[k]) for k, v in out.items()}
