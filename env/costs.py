"""Round pricing shared by the live and the replay environment: the cost kinds and `make_cost_model`.

T_spec = T_draft + T_verify + T_book and T_AR, priced by an env.cost_model.CostModel from the few numbers
both environments know (that module's docstring), so under a deterministic cost model replay == live.

Cost models (`make_cost_model`, `CostConf.kind`):

- "roofline": env.cost_model.RooflineCostModel, engine.cost.roofline's per-layer roofline of a hardware
  profile × model spec with the experts resident on one device, no EP; the drafter priced by a drafter spec.
- "fitted": the measured cost of this machine, fitted to a trace's calibration samples: engine.cost.fitted's
  two-regime linear fit of target seconds (fixed + per token + per active expert + per layer·context), the
  drafter's fitted seconds (engine.cost.drafter_cost.FittedDrafterCost) and the engine's host work per round,
  T_book (engine.cost.host_cost). Verification (n >= 2) is fitted to the recorder's timed forwards; the
  single-token forward (n = 1: a K = 0 round's and T_AR's, one fit to both engines' rounds, robust to timing
  spikes: engine.cost.fitted.fit_cost_model_robust), the drafting and the host work to the timed live rounds at
  batch 1 (env.host_calibration), which run the engine's own code paths. Two surcharges depend on the rounds
  before: the warm-up of a request's first rounds after its prefill (engine.cost.warmup) and switching, a round of
  the other kind than the one before it (engine.cost.switching); the other live fits take the steady rounds that
  kept their kind (`live_fit_rounds`). Since trace format 11 the single-token round and the host work are fitted
  without the rounds a stand-in policy chose (a bare K = 0 run is timed too), and what those rounds cost more (the
  caches the probe and the choice cooled) is charged with a learned controller's choice (`fit_choice`).
- "roofline-offload" (env.cost_offload): the roofline with the routed experts in host memory and a per-layer
  device cache (`offload_cache` = its share of the experts, LRU or LFU); every missed (layer, expert) pair of a
  verification is moved over the profile's PCIe link. Stateful (`stateful = True`): the cache lives for an
  episode, so the replay env adds the transfers at step time; T_AR is priced with plain decoding's own cache.
- "roofline-ep" (env.cost_ep): the roofline under expert parallelism over `ep_ranks` GPUs of one node
  (engine.parallel.placement): slowest rank's expert time + dispatch and combine all-to-alls, from the verified
  nodes' routing ids (`needs_routing = True`: verify and ar take `routing` [n, L, r]).
  Both price replay only (the live env refuses them).

Routing for a model spec whose (MoE layers, experts, top-r) differ from the recorded target's comes from
`engine.cost.node_router.NodeRouter` (identity-keyed synthetic routing); `routing` says which.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.cost.drafter_cost import (
    DRAFT_RULES,
    FittedDrafterCost,
    drafter_spec_from_hf_config,
    fit_drafter_cost,
)
from engine.cost.fitted import (
    CostSample,
    DecodeVerifyCost,
    FittedCost,
    fit_cost_model_robust,
    fit_two_regimes,
)
from engine.cost.host_cost import HostCost, ProbeCost, fit_host_cost, fit_probe_cost
from engine.cost.roofline import load_model_spec, model_spec_from_hf_config
from engine.cost.switching import SwitchCost, fit_switch_cost, switched_rounds
from engine.cost.warmup import STEADY_FROM, WarmupCost, fit_warmup_cost
from env.cost_model import LOOKUP_SPEC, CostModel, RooflineCostModel, RoundCost
from env.models import NGRAM_DRAFTER
from env.shared import view

__all__ = ["CostConf", "CostModel", "FittedCostModel", "RooflineCostModel", "RoundCost", "make_cost_model"]

COST_KINDS = ("roofline", "fitted", "roofline-offload", "roofline-ep")
REPLAY_ONLY_KINDS = ("roofline-offload", "roofline-ep")  # stateful or routing-priced: env.replay only


@dataclass(frozen=True)
class CostConf:
    """Which cost model an environment prices rounds with (mirrored by conf/env/*.yaml `cost`)."""

    kind: str = "roofline"  # roofline | fitted | roofline-offload | roofline-ep
    hardware: str = "h100"  # conf/hardware/<name>.yaml (roofline*)
    model_spec: str = "qwen3_30b_a3b"  # conf/model_spec/<name>.yaml, or "target" (the recorded target)
    drafter_spec: str = "auto"  # conf/drafter_spec/<name>.yaml; auto: <model_spec>_eagle3 (_mtp for MTP heads,
    # prompt_lookup for the n-gram drafter)
    router_seed: int = 0  # identity-keyed synthetic routing (model spec != target shape)
    offload_cache: float = 0.25  # roofline-offload: device cache slots per MoE layer, a fraction of the experts
    offload_policy: str = "lru"  # roofline-offload: lru | lfu (engine.offload.cache)
    ep_ranks: int = 8  # roofline-ep: EP world size (GPUs of one node)
    ep_placement: str = "contiguous"  # roofline-ep: contiguous | round_robin | load_balanced


def draft_rule(spec: Any) -> str:
    """How `spec`'s drafting is priced (DRAFT_RULES): the threshold and calibrated rules score every node as the
    tree grows (FittedDrafterCost prices that), the others ("all", "goodput") select after it."""
    return spec.verify_rule if spec.verify_rule in DRAFT_RULES else "all"


def drafter_steps(depth_cap: int, built_depth: int, spec: Any) -> int:
    """Drafter forwards a round takes: one per depth grown. Under the threshold and calibrated rules growth stops
    at the first depth with no node above the threshold (engine.drafting.tree_growth), after built_depth + 1
    forwards."""
    if spec.verify_rule in ("threshold", "calibrated"):
        return min(depth_cap, built_depth + 1)
    return depth_cap


def as_cost_conf(cost: CostConf | dict | str | None) -> CostConf:
    if cost is None:
        return CostConf()
    if isinstance(cost, CostConf):
        return cost
    if isinstance(cost, str):
        return CostConf(kind=cost)
    if isinstance(cost, Mapping):
        known = {f.name for f in fields(CostConf)}
        unknown = sorted(set(cost) - known)
        if unknown:
            raise ValueError(f"unknown cost fields {unknown}; CostConf has {sorted(known)}")
        return CostConf(**cost)
    raise TypeError(f"cost must be a CostConf, a dict of its fields, a kind name or None, got {type(cost).__name__}")


class FittedCostModel(CostModel):
    """Measured cost of this machine: fitted target, drafter and host seconds (module docstring)."""

    deterministic = True

    def __init__(
        self,
        target: DecodeVerifyCost,
        drafter: FittedDrafterCost,
        routing_shape: tuple[int, int, int],
        host: HostCost | None = None,
        plain_step: FittedCost | None = None,
        probe_fit: ProbeCost | None = None,
        choice_seconds: float | None = None,
        warmup_fit: WarmupCost | None = None,
        switch_fit: SwitchCost | None = None,
        choice_cooling: float = 0.0,
    ) -> None:
        """plain_step: a target-only engine's forward (T_AR's; default `target.decode`); probe_fit: the drafter's timed
        probes (default: priced as drafting, CostModel.probe); choice_seconds: a learned controller's choice, the mean
        of its timings in place (default: CostModel.choice's constant); warmup_fit: the surcharge of a request's first
        rounds (engine.cost.warmup; default none); switch_fit: the surcharge of a round of the other kind than the one
        before it (engine.cost.switching; default none); choice_cooling: what a round after a learned controller's
        probe and choice costs more than one without them (its host work and forward, with the caches they cooled),
        charged with the choice (`choice`)."""
        self.target, self.drafter_fit, self.probe_fit = target, drafter, probe_fit
        self.choice_seconds, self.choice_cooling = choice_seconds, float(choice_cooling)
        self.warmup_fit = warmup_fit if warmup_fit is not None else WarmupCost()
        self.switch_fit = switch_fit if switch_fit is not None else SwitchCost()
        self.host = host if host is not None else HostCost(0.0, 0.0, 0.0, 0.0)
        self.plain_step = plain_step if plain_step is not None else target.decode
        self.routing_shape = routing_shape
        self.name = "fitted"
        self.params = [
            dataclasses.asdict(target.decode),
            dataclasses.asdict(target.verify),
            dataclasses.asdict(drafter),
            dataclasses.asdict(self.host),
            dataclasses.asdict(self.plain_step),
        ] + ([dataclasses.asdict(probe_fit)] if probe_fit is not None else []) + (
            [{"choice_seconds": choice_seconds}] if choice_seconds is not None else []) + (
            [{"choice_cooling": self.choice_cooling}] if self.choice_cooling else []) + (
            [{"warmup": list(self.warmup_fit.seconds)}] if self.warmup_fit.seconds else []) + (
            [dataclasses.asdict(self.switch_fit)] if self.switch_fit.any else [])  # fmt: skip

    def verify(
        self,
        n: int,
        distinct_total: int,
        context_len: int,
        counts: np.ndarray | None = None,
        routing: np.ndarray | None = None,
    ) -> float:
        m = self.target.decode if n <= 1 else self.target.verify
        return m.seconds(n, distinct_total, self.routing_shape[0], context_len)

    def draft(self, drafted_depth: int, width: int, expert_aware: bool, context_len: int, rule: str = "all") -> float:
        return self.drafter_fit.round_cost(drafted_depth, width, context_len, expert_aware, rule)

    def book(self, n: int) -> float:
        return self.host.book(n)

    def book_ar(self) -> float:
        return self.host.plain

    def probe(self, context_len: int, depth: int, width: int) -> float:
        if depth <= 0:
            return 0.0
        return self.probe_fit.seconds(context_len) if self.probe_fit is not None else super().probe(
            context_len, depth, width)  # fmt: skip

    def context_probe(self, context_len: int) -> float:
        return self.probe_fit.seconds(context_len) if self.probe_fit is not None else super().context_probe(
            context_len)  # fmt: skip

    def choice(self) -> float:
        """A learned controller's choice each round: its timing in place and the cooling it leaves the round."""
        own = self.choice_seconds if self.choice_seconds is not None else super().choice()
        return own + self.choice_cooling

    def warmup_cost(self) -> WarmupCost:
        return self.warmup_fit

    def switch_cost(self) -> SwitchCost:
        return self.switch_fit

    def ar(self, context_len: int, routing: np.ndarray | None = None) -> float:
        """T_AR: a target-only engine's step, its forward and its host work."""
        L, _, r = self.routing_shape
        return self.plain_step.seconds(1, L * r, L, context_len) + self.host.plain

    @classmethod
    def from_trace(cls, trace: Any) -> FittedCostModel:
        """Fit every part to a trace's calibration samples and timed live rounds (env.record)."""
        a = trace.arrays
        if len(a["cal_target_seconds"]) < 8 or len(a["cal_draft_seconds"]) < 3:
            raise ValueError(
                f"trace {trace.path} has too few calibration samples for the fitted cost model "
                f"({len(a['cal_target_seconds'])} target, {len(a['cal_draft_seconds'])} drafting): record with "
                "calibrate_every > 0 and more positions, or use cost kind 'roofline'"
            )
        samples = []
        offsets = a["cal_target_offsets"]
        node_offsets = a["node_offsets"]
        _, contexts = trace.position_steps()
        for s, p in enumerate(a["cal_target_position"]):
            nodes = a["cal_target_nodes"][offsets[s] : offsets[s + 1]].astype(np.int64)
            routing = a["node_routing"][node_offsets[p] + nodes]  # [n, L, r]
            samples.append(
                CostSample(
                    [torch.from_numpy(routing[:, l].astype(np.int64)) for l in range(routing.shape[1])],
                    int(contexts[p]),
                    float(a["cal_target_seconds"][s]),
                )
            )
        shape = (trace.num_moe_layers, trace.num_experts, trace.top_r)
        target = fit_two_regimes(samples)
        plain, n, steps = a["cal_live_plain"], a["cal_live_verified"], a["cal_live_draft_steps"]
        # the first rounds after a prefill are slower whatever they run, and a round of the other kind than the one
        # before it costs more: two surcharges fitted to whole rounds (engine.cost.warmup, engine.cost.switching),
        # every other live fit to the steady rounds that kept their kind (`live_surcharges`)
        warmup, switch, steady = live_surcharges(a)
        drafted = steps > 0
        cut = drafted & (n <= 1)  # drafted, then cut to its root (nothing kept, nothing matched)
        # the rounds after the stand-in's probe and choice (a learned controller's, before its K = 0 rounds) run
        # slower than the same rounds without them; with the bare K = 0 run of format 11 they leave the fits below,
        # and what they cost more is priced with the choice (`cooling`)
        bare = bare_k0_rounds(a, steady)
        unchosen = ~(a["cal_live_policy_seconds"] > 0) if bare.any() else np.ones(len(bare), dtype=bool)
        # one single-token forward for K = 0 rounds and a target-only engine's steps (T_AR's): the same code runs
        # both (neither records routing), so one fit to both engines' timed rounds; what the engines do differently
        # around it is their host work (`host`: book(1) and plain)
        decode = _single_token_fit(a, ~drafted & steady & unchosen, shape) or target.decode  # plain_step: it
        keep = ~cut & steady & unchosen  # K = 0, target-only, trees
        host = fit_host_cost(n[keep], a["cal_live_host_seconds"][keep], plain[keep])
        drafted &= steady
        cut &= steady
        # a cut round ran a slower single-token forward and more host work than a K = 0 round (its tree, its cut);
        # that surplus is priced with its drafting
        seconds = a["cal_live_draft_seconds"].astype(np.float64)
        L, _, r = shape
        k0 = [decode.seconds(1, L * r, L, int(c)) + host.single for c in a["cal_live_context"][cut]]
        surplus = a["cal_live_forward_seconds"][cut] + a["cal_live_host_seconds"][cut] - np.asarray(k0)
        seconds[cut] += np.maximum(surplus, 0.0)
        recorded = zip(a["cal_draft_depth"].tolist(), a["cal_draft_width"].tolist(), a["cal_draft_aware"].tolist(),
                       a["cal_draft_seconds"].tolist())  # fmt: skip
        live = zip(steps[drafted].tolist(), a["cal_live_width"][drafted].tolist(), [False] * int(drafted.sum()),
                   seconds[drafted].tolist(), [DRAFT_RULES[i] for i in a["cal_live_rule"][drafted]])  # fmt: skip
        drafter = fit_drafter_cost(list(live) if drafted.sum() >= 3 else list(recorded))
        # the drafter's probe (none: no probe): timed in place before the live K = 0 rounds, as a probing policy runs
        # it, else at every position of the recording (warm, right after its drafting: cheaper)
        live_probed = (a["cal_live_probe_seconds"] > 0) & steady
        if live_probed.sum() >= 3:
            probe = fit_probe_cost(a["cal_live_context"][live_probed], a["cal_live_probe_seconds"][live_probed])
        else:
            probed = a["probe_seconds"] > 0
            probe = fit_probe_cost(contexts[probed], a["probe_seconds"][probed])
        # a learned controller's choice, timed in place before the live K = 0 rounds, and the cooling it leaves them
        choice, cooling = fit_choice(a, steady, bare)
        return cls(DecodeVerifyCost(decode, target.verify), drafter, shape, host, probe_fit=probe,
                   choice_seconds=choice, warmup_fit=warmup, switch_fit=switch, choice_cooling=cooling)  # fmt: skip


MIN_STEADY = 8  # steady rounds each engine needs before the warm-up is fitted


def warmup_and_steady(arrays: dict[str, np.ndarray]) -> tuple[WarmupCost, np.ndarray]:
    """(the warm-up surcharge, the steady rounds [H] the other live fits use) of a trace's timed live rounds: the
    rounds from index STEADY_FROM on, or every round and no surcharge when fewer than MIN_STEADY of them ran on
    either engine."""
    index = arrays["cal_live_round"]
    steady = index >= STEADY_FROM
    plain = arrays["cal_live_plain"]
    if (steady & plain).sum() < MIN_STEADY or (steady & ~plain).sum() < MIN_STEADY:
        return WarmupCost(), np.ones(len(index), dtype=bool)
    fit = fit_warmup_cost(arrays["cal_live_run"], index, arrays["cal_live_verified"], live_seconds(arrays))
    return fit, steady


def fit_choice(arrays: dict[str, np.ndarray], rows: np.ndarray, bare: np.ndarray) -> tuple[float | None, float]:
    """(a learned controller's choice: the mean of its timings in place, None below 3 of them; its cooling: what the
    forward and host work of the K = 0 rounds after it cost more than the same rounds of the bare K = 0 run, `bare`
    [H] (`bare_k0_rounds`), medians, >= 0, 0 without that run) of a trace's timed live rounds among `rows` [H]. Both
    runs decode the same tokens of the same prompts, so the two medians compare like with like; medians, as the
    effect (~2 % of a round) is smaller than a timing spike."""
    chose = (arrays["cal_live_policy_seconds"] > 0) & rows
    if chose.sum() < 3:
        return None, 0.0
    choice = float(arrays["cal_live_policy_seconds"][chose].astype(np.float64).mean())
    k0 = chose & (arrays["cal_live_draft_steps"] == 0) & ~arrays["cal_live_plain"].astype(bool)
    if k0.sum() < 3 or not bare.any():
        return choice, 0.0
    spent = arrays["cal_live_forward_seconds"].astype(np.float64) + arrays["cal_live_host_seconds"]
    return choice, max(float(np.median(spent[k0]) - np.median(spent[bare])), 0.0)


def bare_k0_rounds(arrays: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """[H] the timed live rounds among `rows` of the spec engine's runs that decoded K = 0 without a policy (format
    11's last run: no round drafted, none chose); none where fewer than MIN_STEADY of them are among `rows`. The one
    rule for whether a trace has that run: the fits leave the stand-in's rounds out, and `fit_choice` prices their
    cooling, only then."""
    run, plain = arrays["cal_live_run"], arrays["cal_live_plain"].astype(bool)
    quiet = (arrays["cal_live_draft_steps"] == 0) & (arrays["cal_live_policy_seconds"] == 0)
    runs = [k for k in np.unique(run[~plain]) if quiet[(run == k) & ~plain].all()]
    bare = np.isin(run, runs) & ~plain & rows
    return bare if bare.sum() >= MIN_STEADY else np.zeros(len(run), dtype=bool)


def live_seconds(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """[H] each timed live round's whole seconds: drafting, forward, host work, probe and choice."""
    return sum(arrays[f"cal_live_{k}_seconds"].astype(np.float64)
               for k in ("draft", "forward", "host", "probe", "policy"))  # fmt: skip


def live_surcharges(arrays: dict[str, np.ndarray]) -> tuple[WarmupCost, SwitchCost, np.ndarray]:
    """(the warm-up surcharge, the switching surcharge, the timed live rounds [H] the other live fits use: the steady
    ones, `warmup_and_steady`, that did not switch kind, `switch_and_switched`) of a trace's timed live rounds."""
    warmup, steady = warmup_and_steady(arrays)
    switch, switched = switch_and_switched(arrays)
    return warmup, switch, steady & ~switched


def live_fit_rounds(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """[H] the timed live rounds the fits other than the surcharges use (`live_surcharges`)."""
    return live_surcharges(arrays)[2]


def switch_and_switched(arrays: dict[str, np.ndarray]) -> tuple[SwitchCost, np.ndarray]:
    """(the switching surcharge, the timed live rounds [H] it prices: those after a round of the other kind) of a
    trace's timed live rounds; no surcharge and no round singled out when neither direction could be fitted."""
    run, index, n = arrays["cal_live_run"], arrays["cal_live_round"], arrays["cal_live_verified"]
    fit = fit_switch_cost(run, index, n, live_seconds(arrays))
    if not fit.any:
        return fit, np.zeros(len(index), dtype=bool)
    return fit, switched_rounds(run, index, n)


def _single_token_fit(arrays: dict[str, np.ndarray], rows: np.ndarray, shape: tuple[int, int, int]):
    """FittedCost of the timed live single-token forwards `rows` (fixed + per layer·context: one token routes to
    L·r experts; `fit_cost_model_robust`: timing spikes late in a request set no context slope), or None when they
    cannot identify it."""
    L, _, r = shape
    routing = [torch.arange(r)[None]] * L  # L x [1, r]: Σ_l U_l = L·r, what every single token has
    samples = [CostSample(routing, int(c), float(t))
               for c, t in zip(arrays["cal_live_context"][rows], arrays["cal_live_forward_seconds"][rows])]  # fmt: skip
    if len(samples) < 3:
        return None
    try:
        return fit_cost_model_robust(samples)[0]
    except ValueError:
        return None


def drafter_probes(trace: Any) -> bool:
    """True when the trace's drafter has a probe (`NGramDrafter.probe`; its trace timed one at every position)."""
    return _is_lookup(trace.meta["drafter"]["name"])


def _is_lookup(drafter_name: str | None) -> bool:
    """Whether a trace's drafter name (ModelInfo.drafter_name, "<drafter>[+<predictor>]") is the prompt lookup."""
    return bool(drafter_name) and drafter_name.split("+")[0] == NGRAM_DRAFTER


def drafter_spec_name(conf: CostConf, drafter_name: str | None, model_spec: str) -> str:
    if conf.drafter_spec != "auto":
        return conf.drafter_spec
    if _is_lookup(drafter_name):
        return LOOKUP_SPEC  # model-free: the same host-side lookup whatever the priced model
    kind = "mtp" if drafter_name and "mtp" in drafter_name else "eagle3"
    return f"{model_spec}_{kind}"


def make_cost_model(
    conf: CostConf, target_meta: dict[str, Any], drafter_name: str | None = None, trace: Any = None
) -> CostModel:
    """The CostModel of `conf` for a target described by `target_meta` (a trace's meta["target"]).

    Unknown hardware / model / drafter specs raise ValueError before any work; "fitted" needs `trace`."""
    if conf.kind not in COST_KINDS:
        raise ValueError(f"unknown cost kind {conf.kind!r}; use one of {COST_KINDS}")
    if conf.kind == "fitted":
        if trace is None:
            raise ValueError("the fitted cost model is fitted to a trace's calibration samples: pass a trace")
        # fitted once per trace in this process (seconds for a 500-prompt trace; every env of it prices alike)
        return view("fitted-cost", trace.arrays["cal_target_seconds"], lambda _: FittedCostModel.from_trace(trace))
    if conf.model_spec == "target":
        cfg = json.loads((Path(target_meta["path"]) / "config.json").read_text())
        spec = model_spec_from_hf_config(cfg, name="target")
        head = drafter_spec_from_hf_config(cfg, "eagle3", "target_head")  # a one-layer head at the target's size (zoo)
        drafter = conf.drafter_spec if conf.drafter_spec != "auto" else (LOOKUP_SPEC if _is_lookup(drafter_name)
                                                                         else head)  # fmt: skip
    else:
        spec = load_model_spec(conf.model_spec)
        drafter = drafter_spec_name(conf, drafter_name, conf.model_spec)
    if conf.kind == "roofline-offload":
        from env.cost_offload import OffloadCostModel

        return OffloadCostModel(conf.hardware, spec, drafter, conf.offload_cache, conf.offload_policy)
    if conf.kind == "roofline-ep":
        from env.cost_ep import EPCostModel

        return EPCostModel(conf.hardware, spec, drafter, conf.ep_ranks, conf.ep_placement)
    return RooflineCostModel(conf.hardware, spec, drafter)


def uses_recorded_routing(model: CostModel, target_meta: dict[str, Any]) -> bool:
    """True when the priced model has the recorded target's routing shape (its own routing is used)."""
    shape = (int(target_meta["num_moe_layers"]), int(target_meta["num_experts"]), int(target_meta["top_r"]))
    return tuple(model.routing_shape) == shape
