"""`Engine.generate`: batched target-only and exact speculative decoding over a paged KV cache.

One round per active request per step:

    draft   drafter proposes a tree (K = 0: the root alone)            -> DraftTree
    verify  one target forward over every request's root + nodes       (tree mask, tree positions)
    commit  walk the tree (engine.verify), copy the accepted path's K/V from scratch slots to the
            committed positions, release the scratch, record RoundStats

Cache invariant between rounds: the target cache holds K/V of every committed token except the
last one (the next round's root). Each request owns a per-request `torch.Generator`; a round with
no drafts draws exactly what plain decoding draws, and requests in one batch never share randomness.

Shape letters: B=requests N=tree nodes S=key slots V=vocab L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import kernels
from engine.drafting.make import make_drafter
from engine.drafting.protocol import MAX_TREE_NODES, Drafter
from engine.models.batching import chain_item, pack, tree_item
from engine.models.cuda_graphs import GraphedForward
from engine.models.kv_cache import PagedKVCache
from engine.models.moe import check_expert_budget
from engine.models.transformer import Model
from engine.runtime.footprint import virtual_rank_loads
from engine.runtime.frozen import load_frozen_policy
from engine.runtime.inputs import check_request_inputs
from engine.runtime.kv_check import check_kv_invariant
from engine.runtime.observation import History, Observation, observe_history
from engine.runtime.policy import Policy
from engine.runtime.round_record import round_stats
from engine.runtime.session import Session
from engine.runtime.stats import GenerationResult, RoundStats
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.gumbel import position_gumbel_many, verify_gumbel
from engine.spec.sampling import SamplingParams, process_logits, row_argmax, sample_from_probs
from engine.spec.verify import VerifyResult, verify_tree
from engine.timing import PhaseTimer

GREEDY = SamplingParams()
RoundCost = Callable[[RoundStats], tuple[float, float]]  # RoundStats -> (T_spec, T_AR)


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new: int
    params: SamplingParams
    generator: torch.Generator
    slot_table: torch.Tensor | None = None  # [prompt + max_new] committed slots
    eos_token_id: int | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + committed
    new_tokens: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)
    finish_reason: str | None = None
    prev_pairs: torch.Tensor | None = None  # [L, E] bool experts of the previous round
    history: History = field(default_factory=History)  # the observation's running folds
    held: int = 0  # rounds still to decode plainly unasked, a policy's hold (engine.runtime.hold)
    held_spec: SpecConfig | None = None  # ... with the plain action that started it

    @property
    def cached_len(self) -> int:
        """Positions whose K/V are in the target cache (all committed but the root)."""
        return len(self.tokens) - 1


class Engine:
    """Exact MoE speculative-decoding engine over an `engine.Model` target.

    drafter: None (target-only), a dense `engine.Model` with the target's vocabulary, "ngram", or any
    object implementing `engine.drafters.Drafter`.
    Options: block_size / num_blocks (paged KV; num_blocks None = sized per call), backend ("auto",
    "torch", "triton") for the target's expert GEMM, instrument (routing footprint per round), plain_routing
    (record routing in steps where every request verifies one token, K = 0: their footprint is known, r experts per
    MoE layer, and their overlap is not observed, engine.runtime.round_record; None = only with cost_model or
    rank_loads, which price those experts; True for what-if pricing of one-token rounds' own routing),
    timing (per-phase wall clock of every forward in `RoundStats.time`: the per-op path, whose phases it times, so
    not the CPU's one-call forward, engine.models.cpu_stack; off by default), cost_model (callable RoutingRecord-like
    -> modelled seconds),
    rank_loads (callable L x expert_ids [n, r] -> (imbalance_mean, imbalance_max, cross_node_ratio)) or
    virtual_ep (an `engine.placement.ExpertPlacement`: per-rank loads of a virtual EP layout every round),
    ep (real expert parallelism, see engine.ep), check_kv (debug: prove the KV invariant every round),
    offload (an installed `engine.offload.ExpertOffload`: its `OffloadStats` of every step, prefill
    included in the first, is attached to the step's RoundStats as `offload`), expert_budget (verify with
    at most B experts per MoE layer, MoE-Spec 2602.16052: APPROXIMATE, see engine.models.moe), cuda_graphs
    (target and dense-drafter forwards replayed from CUDA graphs per shape bucket, engine.models.cuda_graphs;
    use with instrument=False, timing=False; on CPU the padded buckets run eagerly, a test of the padding).
    """

    def __init__(
        self,
        target: Model,
        drafter: Model | str | Drafter | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        backend: str = "auto",
        instrument: bool = True,
        plain_routing: bool | None = None,
        timing: bool = False,
        cost_model: Callable[[list[torch.Tensor], int], float] | None = None,
        rank_loads: Callable[[list[torch.Tensor]], tuple[float, float, float]] | None = None,
        virtual_ep: Any = None,
        ep: Any = None,
        check_kv: bool = False,
        offload: Any = None,
        round_cost: RoundCost | None = None,
        calibration: Callable[[float, int], float] | None = None,
        expert_budget: int | None = None,
        cuda_graphs: bool = False,
        acceptance: Any = None,
        **drafter_options: Any,
    ) -> None:
        if not isinstance(target, Model):
            raise TypeError(f"target must be an engine.Model (engine.load_model), got {type(target).__name__}")
        self.target = target
        target.set_backend(backend)  # validates; set again before every forward (the model may be shared)
        self.backend = backend
        self.drafter: Drafter | None = make_drafter(drafter, target, **drafter_options)
        self.feature_layers: tuple[int, ...] | None = getattr(self.drafter, "feature_layers", None)  # EAGLE-3
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.instrument = instrument
        self.timing = timing
        self.cost_model = cost_model
        if virtual_ep is not None and rank_loads is None:
            rank_loads = virtual_rank_loads(virtual_ep, target.config.num_experts)
        self.rank_loads = rank_loads
        # one-token steps record routing only where a one-token round's expert identities are priced
        priced = cost_model is not None or rank_loads is not None
        self.plain_routing = priced if plain_routing is None else plain_routing
        self.kv: PagedKVCache | None = None
        # Expert parallelism (engine.ep): every rank must run the same sequence of MoE collectives, so
        # steps are taken in lockstep (`ep.any_active(local) -> global`) and a rank without work runs
        # `ep.idle_step()` (the collectives of one forward with zero tokens).
        if ep is not None and check_kv:
            raise ValueError("check_kv runs extra target forwards per request and is not lockstep under ep")
        self.ep = ep
        if target.device.type == "cpu":  # the CPU extensions loaded now, never mid-step (EP ranks would stagger)
            kernels.load_cpu_extensions()
        self.check_kv = check_kv  # debug: after every step prove committed slots hold committed tokens' K/V
        self.offload = offload
        self.round_cost = round_cost  # fills RoundStats.cost / cost_ar (None: measured seconds, no T_AR)
        self.calibration = calibration  # draft confidence -> P(accepted), for the observation
        self._obs_model = (target.config.top_r if target.config.is_moe else 0, len(target.moe_blocks))  # (r, L)
        self.acceptance = acceptance  # engine.drafting.acceptance.AcceptanceModel of the "calibrated" rule
        self.expert_budget = check_expert_budget(expert_budget, target.config.num_experts, target.config.top_r)
        self.default_sampling = GREEDY
        self.scratch_tokens = MAX_TREE_NODES + 1  # a draft tree's root + nodes live in scratch slots
        self._session: Session | None = None
        if cuda_graphs and (ep is not None or offload is not None):
            raise ValueError("cuda_graphs does not combine with ep or offload (their expert calls leave the graph)")
        self.cuda_graphs, self._graphed = cuda_graphs, None  # the target's GraphedForward (per KV cache)
        if hasattr(self.drafter, "cuda_graphs"):
            self.drafter.cuda_graphs = cuda_graphs

    # ------------------------------------------------------------------ validation
    def _validate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams | Sequence[SamplingParams],
        spec: SpecConfig | None,
        eos_token_id: int | None,
    ) -> list[SamplingParams]:
        """The request arguments checked against this engine (engine.runtime.inputs); one SamplingParams each."""
        return check_request_inputs(prompts, max_new_tokens, sampling, spec, eos_token_id,
                                    vocab_size=self.target.vocab_size,
                                    context_length=self.target.config.max_position_embeddings,
                                    has_drafter=self.drafter is not None, allow_none=self.ep is not None)  # fmt: skip

    def _check_spec(self, s: SpecConfig) -> None:
        """Errors an action can only have against this engine (SpecConfig validated its own fields)."""
        if s.depth > 0 and self.drafter is None:
            raise ValueError("an action with depth K > 0 needs a drafter: Engine(target, drafter=...)")
        if s.verify_rule == "calibrated" and s.acceptance is None and self.acceptance is None:
            raise ValueError("verify_rule 'calibrated' needs an acceptance model (env.calibration.fit_acceptance): "
                             "Engine(..., acceptance=model) or SpecConfig(acceptance=model)")  # fmt: skip
        if s.lam > 0 and s.depth > 0 and not getattr(self.drafter, "predicts_experts", False):
            raise ValueError(
                f"λ = {s.lam} > 0 needs a drafter with an expert predictor (it prices each node's marginal "
                "experts): e.g. drafter='zoo/eagle-head' with predictor='zoo/expert-predictor'; this drafter "
                f"({type(self.drafter).__name__}) has none, so use λ = 0"
            )

    # ------------------------------------------------------------------ public entry
    @torch.inference_mode()
    def start(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        spec: SpecConfig | None = None,
        policy: Policy | None = None,
        eos_token_id: int | None = None,
        reserve_tokens: int = 0,
    ) -> Session:
        """Open a steppable session over `prompts` (see engine.runtime.session). `reserve_tokens`: KV room
        beyond these requests for requests added later with `session.add` (Engine(num_blocks=...) fixes it)."""
        if self._session is not None and not self._session.closed:
            raise RuntimeError("this engine already has an open session: close() it before starting another")
        self._validate(prompts, max_new_tokens, sampling, spec, eos_token_id)
        if spec is not None:
            self._check_spec(spec)
        if isinstance(policy, (str, os.PathLike)):  # a frozen learned policy folder (ctrl.freeze)
            policy = load_frozen_policy(policy)
        if policy is not None and not callable(policy):
            raise TypeError("policy must be a callable obs -> action or a frozen policy folder")
        if policy is not None and self.drafter is None:
            raise ValueError("a policy chooses speculation settings and needs a drafter")
        if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be an int >= 0, got {reserve_tokens!r}")
        lengths = [len(p) + max_new_tokens for p in prompts]
        kv = self._make_cache(lengths, reserve_tokens)
        if self.offload is not None:
            self.offload.stats.reset()
        if self.drafter is not None:
            self.drafter.prepare(lengths + ([reserve_tokens] if reserve_tokens else []))
        session = Session(self, kv, spec, policy)
        self._session = session
        try:
            session.add(prompts, max_new_tokens, sampling, eos_token_id)
        except BaseException:
            session.close()
            raise
        return session

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        spec: SpecConfig | None = None,
        policy: Policy | None = None,
        eos_token_id: int | None = None,
    ) -> list[GenerationResult]:
        """Generate up to `max_new_tokens` for each prompt; see the module docstring. The loop over a session."""
        session = self.start(prompts, max_new_tokens, sampling, spec, policy, eos_token_id)
        try:
            while not session.done:
                session.step()
            return session.results()
        finally:
            session.close()

    # ------------------------------------------------------------------ cache
    def _make_cache(self, lengths: list[int], reserve_tokens: int = 0) -> PagedKVCache:
        bs = self.block_size
        need = sum(-(-n // bs) for n in lengths) + -(-reserve_tokens // bs)
        scratch = (len(lengths) + (1 if reserve_tokens else 0)) * (-(-self.scratch_tokens // bs) + 1)
        blocks = self.num_blocks or max(1, need + scratch) + (1 if self.cuda_graphs else 0)  # +1: graph padding
        if blocks < need + len(lengths):
            raise ValueError(f"num_blocks={blocks} cannot hold these requests ({need} blocks needed)")
        cfg = self.target.config
        kv = self.kv
        if kv is None or kv.num_blocks < blocks or kv.block_size != bs or kv.k.dtype != self.target.dtype:
            kv = PagedKVCache.for_model(cfg, blocks, bs, self.target.dtype, self.target.device)
            self.kv = kv
        kv.check_quiescent()
        return kv

    def _new_request(self, rid: int, prompt, max_new: int, params: SamplingParams, generator) -> _Request:
        if params.mode == "position":  # the noise key: the request's stream seed (seed + j if shared, drawn if None)
            params = replace(params, seed=generator.initial_seed())
        return _Request(index=rid, prompt=list(prompt), max_new=max_new, params=params, generator=generator,
                        tokens=list(prompt))  # fmt: skip

    def _admit(self, reqs: list[_Request], kv: PagedKVCache) -> None:
        """Prefill requests (new ones: their prompt; a rolled-back step: every committed token) and start their
        drafter state."""
        self.target.set_backend(self.backend)
        hidden = self._prefill(reqs, kv)
        if self.drafter is not None:
            for r in reqs:
                self.drafter.start(r.index, r.tokens, target_hidden=hidden.get(r.index))

    # ------------------------------------------------------------------ forward helpers
    def _prefill(self, reqs: list[_Request], kv: PagedKVCache) -> dict[int, torch.Tensor]:
        """Cache every committed token (at admission: the prompt) but the last, which is the next round's root.

        Returns the target's final hidden states [len(tokens) - 1, D] (or `feature_layers` ones) per request."""
        items, owners = [], []
        for r in reqs:
            n = r.cached_len
            if n > 0:
                slots = r.slot_table[:n].cpu()
                items.append(chain_item(r.tokens[:-1], slots[:0], slots))
                owners.append(r)
        hidden: dict[int, torch.Tensor] = {}
        if items:
            out = self._forward(pack(items, self.target.device), kv, feature_layers=self.feature_layers)
            feats = out.hidden if out.features is None else out.features
            off = 0
            for r in owners:
                n = r.cached_len
                hidden[r.index] = feats[off : off + n]
                off += n
        elif self.ep is not None:
            self.ep.idle_step()
        return hidden

    def _forward(self, batch, kv: PagedKVCache, **kwargs):
        """The target's cached forward: `Model.forward_batch`, or its CUDA-graph replay (`cuda_graphs`)."""
        if not self.cuda_graphs:
            return self.target.forward_batch(batch, kv, **kwargs)
        if self._graphed is None or self._graphed.kv is not kv:
            self._graphed = GraphedForward(self.target, kv)
        return self._graphed(batch, kv, **kwargs)

    def _any_active(self, local: bool) -> bool:
        return local if self.ep is None else bool(self.ep.any_active(local))

    # ------------------------------------------------------------------ one step
    def _step(
        self,
        active: list[_Request],
        kv: PagedKVCache,
        actions: list[SpecConfig],
        started: float | None = None,
        choosing: float = 0.0,
        probing: Mapping[int, float] | None = None,
    ) -> None:
        """One round for every request in `active` with its validated action (SpecConfig).

        started: perf_counter() when the caller's step began (Session.step: before the actions were chosen and
        checked), `choosing` the seconds of that spent choosing them; the step's host work (RoundStats.host_seconds)
        is the wall time since then minus choosing, drafting and the target's forward. `probing`: request id -> the
        seconds its drafter's probe took before the choice (Session.probe; RoundStats.probe_seconds, a part of
        round_seconds, not of host work)."""
        started = time.perf_counter() if started is None else started
        probing = probing or {}
        self.target.set_backend(self.backend)
        timer = PhaseTimer() if self.timing else None
        trees: list[DraftTree] = []
        specs: list[SpecConfig] = []
        drafting = []
        for r, s in zip(active, actions):
            remaining = r.max_new - len(r.new_tokens)
            if s.depth > 0 and self.drafter is not None and remaining > 1:
                s = _round_spec(s, remaining, self.acceptance)
                drafting.append(len(trees))
            specs.append(s)
            trees.append(DraftTree.root_only(r.tokens[-1]))
        if drafting:
            reqs = [
                (active[i].index, active[i].tokens, specs[i], active[i].params, active[i].generator) for i in drafting
            ]
            t_draft = time.perf_counter()
            drafted = self.drafter.draft_many(reqs)  # one drafter forward per depth for the whole batch
            draft_wall = time.perf_counter() - t_draft
            for i, tree in zip(drafting, drafted):
                trees[i] = tree
        else:
            draft_wall = 0.0
        items = []
        scratch: list[torch.Tensor] = []
        for r, tree in zip(active, trees):
            n = tree.num_nodes
            ctx = r.slot_table[: r.cached_len + 1].cpu()
            node_slots = kv.scratch_slots(r.index, n - 1) if n > 1 else torch.empty(0, dtype=torch.long)
            scratch.append(node_slots)
            items.append(tree_item(tree.tokens, tree.parents, tree.depths, ctx[:-1], torch.cat([ctx[-1:], node_slots])))
        t0 = time.perf_counter()
        verifying = any(t.num_nodes > 1 for t in trees)
        budget = self.expert_budget if verifying else None  # verification forwards only
        record = self.instrument and (verifying or self.plain_routing)
        footprint_shape = self._obs_model[::-1] if self.instrument else (0, 0)  # (L, r): one-token footprints
        out = self._forward(
            pack(items, self.target.device), kv, record_routing=record, timer=timer, expert_budget=budget,
            feature_layers=self.feature_layers,
        )  # fmt: skip
        feats = out.hidden if out.features is None else out.features
        forward_seconds = time.perf_counter() - t0
        phase = timer.reset() if timer is not None else {}
        offload_stats = None
        if self.offload is not None:  # drafting (stand-ins, prefetch) + verification loads of this step
            offload_stats = self.offload.stats.snapshot()
            self.offload.stats.reset()
        off = 0
        done: list[tuple[_Request, RoundStats]] = []
        for r, tree, s, a, node_slots in zip(active, trees, specs, actions, scratch):
            n = tree.num_nodes
            t1 = time.perf_counter()
            logits = out.logits[off : off + n]
            result = self._verify(r, tree, logits, s)
            accepted = result.accepted_nodes
            if accepted:
                src = node_slots[torch.tensor(accepted) - 1]
                L0 = r.cached_len + 1
                kv.copy_slots(src.to(kv.k.device), r.slot_table[L0 : L0 + len(accepted)])
            kv.release_scratch(r.index)
            committed = self._commit(r, result.committed_tokens, r.eos_token_id)
            if self.drafter is not None:
                self.drafter.commit(r.index, r.tokens, tree, accepted, target_hidden=feats[off : off + n])
            book = time.perf_counter() - t1
            routing = out.routing.expert_ids if record and out.routing is not None else None
            stats = round_stats(r, tree, s, a, result, committed, routing or None, self.target.config.num_experts,
                                self.rank_loads, self.cost_model, start=off, shape=footprint_shape)  # fmt: skip
            stats.time = {**phase, "draft": tree.draft_seconds, "forward": forward_seconds, "sampling": book}
            stats.offload = offload_stats
            stats.batch_size = len(active)
            done.append((r, stats))
            off += n
        if self.check_kv:
            check_kv_invariant(self.target, kv, active)
        probe_wall = sum(probing.values())
        host = max(0.0, time.perf_counter() - started - choosing - probe_wall - draft_wall - forward_seconds)
        for r, stats in done:  # the whole step's host work, as its forward is the whole batch's (RoundStats)
            stats.host_seconds = host
            stats.probe_seconds = probing.get(r.index, 0.0)
            stats.round_seconds = forward_seconds + stats.time["draft"] + stats.probe_seconds + host
            if self.round_cost is not None:
                stats.cost, stats.cost_ar = self.round_cost(stats)
            r.rounds.append(stats)
            r.history.add(stats)

    def _verify(self, r: _Request, tree: DraftTree, logits: torch.Tensor, s: SpecConfig):
        if r.params.position_keyed:  # y_p = argmax(log p_target + g_p), also for K = 0 (engine.spec.gumbel)
            first = len(r.tokens)  # absolute position of the first token this round commits
            positions = range(first, first + tree.max_depth + 1)
            noise = position_gumbel_many(r.params.seed, positions, logits.shape[-1], logits.device)
            return verify_gumbel(tree.tokens, tree.parents, process_logits(logits, r.params), noise)
        if tree.num_nodes == 1:  # plain decode: the same draw as target-only sampling
            if r.params.greedy:
                tok = row_argmax(logits[0])
            else:
                tok = sample_from_probs(process_logits(logits[0], r.params), r.generator)
            return VerifyResult(accepted_nodes=[], committed_tokens=[tok], bonus=True, rejection_depth=None)
        # greedy walks the argmax, which raw logits and their one-hots share (first index on ties): no [N, V] one-hot
        target_probs = logits if r.params.greedy else process_logits(logits, r.params)
        draft_probs = tree.draft_probs if (s.use_drafted_children and not r.params.greedy) else None
        return verify_tree(tree.tokens, tree.parents, target_probs, r.params, r.generator, draft_probs)

    def _commit(self, r: _Request, tokens: list[int], eos_token_id: int | None) -> int:
        room = r.max_new - len(r.new_tokens)
        tokens = tokens[:room]
        if eos_token_id is not None and eos_token_id in tokens:
            tokens = tokens[: tokens.index(eos_token_id) + 1]
            r.finish_reason = "eos"
        r.tokens.extend(tokens)
        r.new_tokens.extend(tokens)
        if r.finish_reason is None and len(r.new_tokens) >= r.max_new:
            r.finish_reason = "length"
        return len(tokens)

    # ------------------------------------------------------------------ policy interface
    def observe_request(self, req: _Request, batch_size: int = 1, probe: Sequence[float] = ()) -> Observation:
        """The Observation a policy sees before `req`'s next round (engine.runtime.observation.observe; `probe`: its
        `confidence_now`)."""
        top_k, layers = self._obs_model
        return observe_history(
            req.history,
            position=len(req.new_tokens),
            max_new_tokens=req.max_new,
            prompt_len=len(req.prompt),
            batch_size=batch_size,
            calibration=self.calibration,
            top_k=top_k,
            num_moe_layers=layers,
            request_id=req.index,
            probe=probe,
        )


def _round_spec(s: SpecConfig, remaining: int, acceptance: Any) -> SpecConfig:
    """The action as this round drafts it: never past the request's end, the calibrated rule with a model."""
    if s.depth >= remaining:
        s = replace(s, depth=remaining - 1)
    return replace(s, acceptance=acceptance) if s.verify_rule == "calibrated" and s.acceptance is None else s
