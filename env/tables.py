"""What every action yields at every position of a trace, precomputed so a replay step is a lookup.

For position p (root = last committed token, t = its index in the request) and a SpecConfig s:

    grown     = tree(Kd, W), Kd = min(K, remaining - 1): the depth-Kd prefix of the recorded tree(Kmax, W)
                in the drafter's node order (env.trace); s.verify_rule "threshold" keeps, as the drafter's
                growth does (engine.drafting.tree_growth), the nodes of path probability >= the threshold
                whose parent is kept, and the confidence per depth over those nodes; "calibrated" the same
                with the calibrated path probability (engine.drafting.acceptance) of the recorded nodes
    verified  = engine.drafting.selection.select_verified(grown, s): the drafters' own selection (λ > 0
                expert-aware with the recorded predictions, max_verify, goodput)
    accepted  = depth of the deepest verified node on the continuation's path (greedy / position-keyed
                sampling: the target's choice at each node is the continuation's next token)
    committed = min(accepted + 1, tokens left in the continuation)
    footprint = engine.runtime.footprint.round_footprint of the verified nodes' routing (the recorded
                target's, or identity-keyed synthetic routing of the priced model: engine.cost.node_router)
    cost      = env.costs.CostModel: T_draft(Kd, W, λ > 0) + T_verify(n, Σ U_l, context) + T_book, and T_AR
                (+ plain decoding's round-t warm-up, engine.cost.warmup; a policy's rounds pay theirs in env.replay)
                (roofline-ep prices from the verified nodes' routing ids; roofline-offload, stateful, adds to
                `cost` the expert transfers against the cache plain decoding holds at p — the oracle's
                stateless proxy; `o_verify` stays resident-only and the replay env adds the transfers against
                the episode's own cache — and T_AR includes the root's transfers against that plain cache)

`PositionReplayer.outcome(spec)` does this for any SpecConfig the trace covers (replay of off-grid
policies); `build_tables` runs it for every grid action and stores the distinct outcomes once per
position, `outcome[p, a]` pointing at them. `overlap_prev` depends on the previous round and is computed
at step time from the outcomes' (layer, expert) pair bitsets. Tables are cached under
engine.paths.cache_dir()/replay, keyed by trace digest, grid, cost model and TABLES_VERSION.

Shape letters: P=positions A=actions O=outcomes L=MoE layers E=experts r=top-r N=union nodes K=Kmax.
"""

from __future__ import annotations

import hashlib
import io
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.cost.node_router import NodeRouter, child_key
from engine.drafting.acceptance import AcceptanceModel
from engine.drafting.selection import select_verified
from engine.drafting.tree_growth import kept_by_score
from engine.paths import cache_dir
from engine.runtime.action_grid import ActionGrid
from engine.runtime.footprint import round_footprint
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from env.actions import ActionCodec
from env.cost_model import CostModel
from env.cost_offload import pairs_mask, root_mask
from env.costs import draft_rule, drafter_steps
from env.trace import Trace, atomic_write_bytes

TABLES_VERSION = 5  # 4: NodeRouter's cross-layer following acts on fresh noise (overlap 0.37, not 0.81); 5: warm-up


def footprint_of(ids: np.ndarray, num_experts: int):
    """round_footprint (the engine's own function) of verified nodes' routing ids [n, L, r], root first."""
    return round_footprint(torch.from_numpy(ids.astype(np.int64)), num_experts, None)


def pairs_int(fp) -> int:
    """A Footprint's (layer, expert) pairs [L, E] as a Python-int bitset."""
    return int.from_bytes(np.packbits(fp.pairs.numpy().reshape(-1)).tobytes(), "big")


def synthetic_routing(trace: Trace, router: NodeRouter) -> np.ndarray:
    """Identity-keyed routing of every union node of the trace under `router` -> [M, L, r] int16."""
    out = np.zeros((len(trace.node_token), router.num_layers, router.top_r), dtype=np.int16)
    for i in range(trace.num_requests):
        cont = trace.continuation_of(i).tolist()
        key = router.sequence_key(trace.prompt(i).tolist())
        lat = router.latent([key], None)[0]
        for t, p in enumerate(trace.positions_of(i)):
            sl = trace.nodes_of(p)
            out[sl] = router.route_tree(key, lat, trace.node_token[sl].tolist(), trace.node_parent[sl].tolist())[0]
            key = child_key(key, cont[t])
            lat = router.latent([key], lat[None])[0]
    return out


@dataclass(frozen=True)
class Outcome:
    """What one round yields at one position (everything RoundStats needs that does not depend on history)."""

    accepted: int
    committed: int
    n: int  # verified tokens
    built: int  # depth of the verified tree
    bonus: bool  # bonus and n > 1 (RoundStats.bonus)
    rejection: int  # -1: none
    tried: int  # depth levels the walk attempted
    distinct: tuple[int, ...]  # [L] U_l
    reuse: float
    new_pairs: float
    verify: float  # T_verify
    pairs: int  # (layer, expert) bitset
    confidence: tuple[float, ...]  # draft confidence per depth, [:built]
    tokens_per_expert: np.ndarray | None  # [L, E] (recorded routing only)


class PositionReplayer:
    """Replays any SpecConfig at one trace position (module docstring)."""

    def __init__(
        self,
        trace: Trace,
        p: int,
        request: int,
        t: int,
        routing: np.ndarray,
        cost: CostModel,
        keep_tokens_per_expert: bool,
        acceptance: AcceptanceModel | None = None,
    ) -> None:
        self.trace, self.p, self.cost = trace, p, cost
        self.request, self.acceptance = request, acceptance
        self._calibrated: dict[str, np.ndarray] = {}  # acceptance digest -> calibrated path prob [N]
        sl = trace.nodes_of(p)
        self.par = trace.node_parent[sl].astype(np.int64)
        self.dep = trace.node_depth[sl].astype(np.int64)
        self.pp = trace.node_path_prob[sl]
        self.cp = trace.node_cond_prob[sl].astype(np.float64)
        self.ids = routing[sl]
        self.pred = trace.predicted(p) if trace.has_predictions else None
        self.keep_tpe = keep_tokens_per_expert
        cont = trace.continuation_of(request)
        T = len(cont)
        self.left = T - t
        tok = trace.node_token[sl]
        N = len(tok)
        on_path = np.zeros(N, dtype=bool)
        on_path[0] = True
        for j in range(1, N):
            d = int(self.dep[j])
            on_path[j] = on_path[self.par[j]] and t + d - 1 < T and int(tok[j]) == int(cont[t + d - 1])
        self.on_path = on_path
        remaining = int(trace.meta["max_new_tokens"]) - t
        self.depth_cap = min(trace.kmax, remaining - 1) if remaining > 1 else 0
        self.t = t
        self.context = len(trace.prompt(request)) + t - 1
        # the root's routing; plain decoding's round t is position t: its warm-up surcharge (engine.cost.warmup)
        self.ar = cost.ar(self.context, self.ids[:1] if cost.needs_routing else None) + cost.warmup(t)
        self._orders = {}
        self._cache: dict[tuple, tuple[tuple[int, ...], tuple[float, ...]]] = {}
        self._outcomes: dict[tuple, Outcome] = {}
        self._draft: dict[tuple, float] = {}  # (drafter forwards, W, expert-aware) -> T_draft at this position
        self._as_lists: tuple | None = None

    def _order(self, width: int) -> np.ndarray:
        o = self._orders.get(width)
        if o is None:
            if width not in self.trace.widths:
                raise ValueError(f"width {width} was not recorded in this trace (widths {self.trace.widths})")
            o = self._orders[width] = self.trace.tree_order(self.p, self.trace.widths.index(width)).astype(np.int64)
        return o

    def drafted_depth(self, spec: SpecConfig) -> int:
        return min(spec.depth, self.depth_cap) if spec.depth > 0 else 0

    def spec_key(self, spec: SpecConfig) -> tuple:
        """What of `spec` (besides its drafted depth) decides the verified set; the same at every position, so
        `build_tables` computes it once per action. Checks the spec is replayable."""
        if spec.frontier not in (None, spec.width):
            raise ValueError(f"the trace recorded frontier = W trees; frontier {spec.frontier} is not replayable")
        if spec.depth > self.trace.kmax:
            raise ValueError(f"depth {spec.depth} exceeds the trace's recorded Kmax {self.trace.kmax}")
        return (
            spec.width,
            spec.lam > 0,
            spec.lam,
            spec.max_verify,
            spec.score,
            spec.verify_rule,
            spec.verify_threshold if spec.verify_rule in ("threshold", "calibrated") else None,
            spec.verify_costs if spec.verify_rule == "goodput" else None,
            self._model(spec).digest if spec.verify_rule == "calibrated" else None,
        )

    def verified(self, spec: SpecConfig, skey: tuple | None = None) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(verified union node indices sorted with the root first, confidence per depth of the grown tree);
        `skey`: `spec_key(spec)` when the caller has it."""
        kd = self.drafted_depth(spec)
        key = (kd, *(skey if skey is not None else self.spec_key(spec)))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if kd == 0:
            res = ((0,), ())
            self._cache[key] = res
            return res
        order = self._order(spec.width)
        grown = order[self.dep[order] <= kd]  # [n] the drafter's node order, root first
        if spec.verify_rule in ("threshold", "calibrated"):  # growth stops below the threshold (TreeGrowth.grow)
            if spec.verify_rule == "threshold":  # float32 scores: compared in float32, as numpy does (NEP 50)
                score, thr = self._lists()[3], float(np.float32(spec.verify_threshold))
            else:
                score, thr = self.calibrated(self._model(spec)).tolist(), float(spec.verify_threshold)
            par, dep, cp, _ = self._lists()  # pure Python lists: ~10x faster than numpy scalar indexing here
            keep, confidence = kept_by_score(grown.tolist(), score, thr, par, dep, cp)
            grown = np.asarray(keep, dtype=np.int64)
        else:
            confidence = self.trace.confidence[self.p, self.trace.widths.index(spec.width), :kd].tolist()
        if len(grown) == 1:
            res = ((0,), tuple(confidence))
            self._cache[key] = res
            return res
        expert_aware = spec.lam > 0 and self.pred is not None
        if not expert_aware and spec.max_verify is None and not (spec.verify_rule == "goodput" and spec.verify_costs):
            res = (tuple(sorted(grown.tolist())), tuple(confidence))  # select_verified keeps every node
            self._cache[key] = res
            return res
        where = {int(j): i for i, j in enumerate(grown)}
        tree = DraftTree(
            tokens=torch.from_numpy(grown),  # union indices ride along in `tokens`: selection never reads tokens
            parents=torch.tensor([-1] + [where[int(self.par[j])] for j in grown[1:]]),
            depths=torch.from_numpy(self.dep[grown]),
            path_prob=torch.from_numpy(self.pp[grown].astype(np.float32)),
            confidence=confidence,
            predicted_experts=torch.from_numpy(self.pred[grown]) if expert_aware else None,
        )
        chosen = select_verified(tree, spec, drafted=False)
        res = (tuple(sorted(chosen.tokens.tolist())), tuple(confidence))
        self._cache[key] = res
        return res

    def _lists(self) -> tuple[list[int], list[int], list[float], list[float]]:
        """(parent, depth, float32 conditional probability, path probability) of the union nodes as Python lists."""
        if self._as_lists is None:
            self._as_lists = (self.par.tolist(), self.dep.tolist(), self.cp.astype(np.float32).tolist(),
                              self.pp.tolist())  # fmt: skip
        return self._as_lists

    def _model(self, spec: SpecConfig) -> AcceptanceModel:
        model = spec.acceptance if spec.acceptance is not None else self.acceptance
        if model is None:
            raise ValueError("verify_rule 'calibrated' needs an acceptance model: ReplayEnv(..., acceptance=model)")
        return model

    def calibrated(self, model: AcceptanceModel) -> np.ndarray:
        """[N] calibrated path probability of every union node (engine.drafting.acceptance, as TreeGrowth)."""
        out = self._calibrated.get(model.digest)
        if out is None:
            sl = self.trace.nodes_of(self.p)
            ctx = self.trace.prompt(self.request).tolist() + self.trace.continuation_of(self.request)[: self.t].tolist()
            tok = self.trace.node_token[sl].tolist()
            out = self._calibrated[model.digest] = np.asarray(model.tree(ctx, tok, self.par.tolist(), self.cp.tolist()))
        return out

    def outcome(self, spec: SpecConfig, skey: tuple | None = None) -> Outcome:
        V, confidence = self.verified(spec, skey)
        key = (V, confidence)
        o = self._outcomes.get(key)
        if o is not None:
            return o
        nodes = np.asarray(V, dtype=np.int64)
        n = len(nodes)
        if n > 1:
            path = nodes[self.on_path[nodes]]
            deepest = int(path[np.argmax(self.dep[path])])
            accepted = int(self.dep[deepest])
            has_child = bool(np.any(self.par[nodes] == deepest))
            bonus, tried, built = not has_child, accepted + int(has_child), int(self.dep[nodes].max())
        else:
            accepted, bonus, tried, built = 0, True, 0, 0
        fp = footprint_of(self.ids[nodes], self.cost.routing_shape[1])
        counts = fp.tokens_per_expert.numpy()
        verify = self.cost.verify(
            n,
            int(sum(fp.distinct_experts)),
            self.context,
            counts if self.cost.needs_counts(n) else None,
            self.ids[nodes] if self.cost.needs_routing else None,
        )
        o = Outcome(
            accepted=accepted,
            committed=min(accepted + 1, self.left),
            n=n,
            built=built,
            bonus=bonus and n > 1,
            rejection=-1 if bonus or n == 1 else accepted + 1,
            tried=tried,
            distinct=tuple(fp.distinct_experts),
            reuse=float(fp.reuse),
            new_pairs=float(fp.new_pairs_per_node),
            verify=float(verify),
            pairs=pairs_int(fp),
            confidence=tuple(confidence[:built]),
            tokens_per_expert=counts.astype(np.int16) if self.keep_tpe else None,
        )
        self._outcomes[key] = o
        return o

    def draft_cost(self, spec: SpecConfig, predicts: bool, skey: tuple | None = None) -> float:
        kd = self.drafted_depth(spec)
        if kd <= 0:
            return 0.0
        steps = drafter_steps(kd, self.outcome(spec, skey).built, spec)
        if steps <= 0:
            return 0.0
        key = (steps, spec.width, spec.lam > 0 and predicts, draft_rule(spec))  # many actions draft the same forwards
        c = self._draft.get(key)
        if c is None:
            c = self._draft[key] = self.cost.draft(steps, spec.width, key[2], self.context, key[3])
        return c


# ---------------------------------------------------------------------------------------------- tables
@dataclass
class ReplayTables:
    """Per-position, per-action outcomes of a trace over a grid (module docstring). Arrays are numpy."""

    outcome: np.ndarray  # [P, A] int32 global outcome index
    cost: np.ndarray  # [P, A] float64 T_spec
    draft_cost: np.ndarray  # [P, A] float64 T_draft
    committed_pa: np.ndarray  # [P, A] int16 committed tokens of the action
    ar: np.ndarray  # [P] float64 T_AR
    context: np.ndarray  # [P] int32 KV tokens before the round
    o_accepted: np.ndarray  # [O] int8
    o_committed: np.ndarray  # [O] int16
    o_n: np.ndarray  # [O] int16 verified tokens
    o_built: np.ndarray  # [O] int8 built depth
    o_bonus: np.ndarray  # [O] bool
    o_rejection: np.ndarray  # [O] int8 (-1: none)
    o_tried: np.ndarray  # [O] int8
    o_distinct: np.ndarray  # [O, L] int16 U_l
    o_reuse: np.ndarray  # [O] float64
    o_new_pairs: np.ndarray  # [O] float64
    o_verify: np.ndarray  # [O] float64 T_verify
    o_book: np.ndarray  # [O] float64 T_book
    o_pairs: np.ndarray  # [O, ceil(L*E/8)] uint8 packed pair bitsets
    o_confidence: np.ndarray  # [O, K] float32 draft confidence per depth ([:built] is used)
    o_tokens_per_expert: np.ndarray  # [O, L, E] int16, or [O, 0, 0] for synthetic routing

    def pair_ints(self) -> list[int]:
        """Pair bitsets as Python ints (fast & and popcount at step time)."""
        return [int.from_bytes(row.tobytes(), "big") for row in self.o_pairs]

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, **{k: getattr(self, k) for k in self.__dataclass_fields__})
        return buf.getvalue()

    @classmethod
    def from_file(cls, path) -> ReplayTables:
        with np.load(path, allow_pickle=False) as z:
            return cls(**{k: z[k] for k in cls.__dataclass_fields__})


def replayers(trace: Trace, routing: np.ndarray, cost: CostModel, keep_tpe: bool, acceptance=None):
    """Yield (global position, PositionReplayer) over the whole trace."""
    for i in range(trace.num_requests):
        for t, p in enumerate(trace.positions_of(i)):
            yield p, PositionReplayer(trace, p, i, t, routing, cost, keep_tpe, acceptance)


def build_tables(
    trace: Trace,
    grid: ActionGrid,
    cost: CostModel,
    routing: np.ndarray,
    keep_tpe: bool,
    on_position: Callable[[], None] | None = None,
    acceptance: AcceptanceModel | None = None,
) -> ReplayTables:
    """Precompute ReplayTables for every action of `grid` (module docstring); `acceptance`: the calibrated
    rule's model (needed when the grid has that rule)."""
    codec = ActionCodec(grid)
    indices = [codec.unflat(a) for a in range(codec.num_actions)]
    specs = [grid.spec(idx) for idx in indices]
    L, E, _ = cost.routing_shape
    P, A, K = trace.num_positions, codec.num_actions, trace.kmax
    predicts = trace.has_predictions
    outcome = np.zeros((P, A), dtype=np.int32)
    cost_pa, draft_pa = np.zeros((P, A)), np.zeros((P, A))
    committed_pa = np.zeros((P, A), dtype=np.int16)
    ar, context = np.zeros(P), np.zeros(P, dtype=np.int32)
    rows: list[Outcome] = []
    plain = None  # stateful cost (roofline-offload): the device cache plain decoding holds at this position
    skeys = None
    for p, rp in replayers(trace, routing, cost, keep_tpe, acceptance):
        if skeys is None:  # per action, the same at every position
            skeys = [rp.spec_key(spec) for spec in specs]
        ar[p], context[p] = rp.ar, rp.context
        if cost.stateful and rp.t == 0:
            plain = cost.new_state()
        local: dict[int, int] = {}
        transfer: dict[int, float] = {}
        for a, spec in enumerate(specs):
            skey = skeys[a]
            o = rp.outcome(spec, skey)
            g = local.get(id(o))
            if g is None:
                g = local[id(o)] = len(rows)
                rows.append(o)
                if plain is not None:  # the DP's stateless proxy: transfers against plain decoding's cache
                    transfer[g] = cost.transfer(plain.peek(pairs_mask(o.pairs, L, E)))
            d = rp.draft_cost(spec, predicts, skey)
            outcome[p, a] = g
            draft_pa[p, a] = d
            if plain is None:
                cost_pa[p, a] = d + o.verify + cost.book(o.n)
            else:
                cost_pa[p, a] = d + o.verify + transfer[g] + cost.book(o.n)
            committed_pa[p, a] = o.committed
        if plain is not None:  # T_AR: the root's misses against plain decoding's cache, which then serves it
            ar[p] = rp.ar + cost.transfer(int(plain.access(root_mask(rp.ids[0], E)).sum()))
        if on_position is not None:
            on_position()
    O = len(rows)
    conf = np.zeros((O, K), dtype=np.float32)
    for j, o in enumerate(rows):
        conf[j, : len(o.confidence)] = o.confidence
    nbytes = -(-(L * E) // 8)
    pairs = np.zeros((O, nbytes), dtype=np.uint8)
    for j, o in enumerate(rows):
        pairs[j] = np.frombuffer(o.pairs.to_bytes(nbytes, "big"), dtype=np.uint8)
    return ReplayTables(
        outcome=outcome,
        cost=cost_pa,
        draft_cost=draft_pa,
        committed_pa=committed_pa,
        ar=ar,
        context=context,
        o_accepted=np.asarray([o.accepted for o in rows], dtype=np.int8),
        o_committed=np.asarray([o.committed for o in rows], dtype=np.int16),
        o_n=np.asarray([o.n for o in rows], dtype=np.int16),
        o_built=np.asarray([o.built for o in rows], dtype=np.int8),
        o_bonus=np.asarray([o.bonus for o in rows], dtype=bool),
        o_rejection=np.asarray([o.rejection for o in rows], dtype=np.int8),
        o_tried=np.asarray([o.tried for o in rows], dtype=np.int8),
        o_distinct=np.asarray([o.distinct for o in rows], dtype=np.int16).reshape(O, L),
        o_reuse=np.asarray([o.reuse for o in rows]),
        o_new_pairs=np.asarray([o.new_pairs for o in rows]),
        o_verify=np.asarray([o.verify for o in rows]),
        o_book=np.asarray([cost.book(o.n) for o in rows]),
        o_pairs=pairs,
        o_confidence=conf,
        o_tokens_per_expert=np.stack([o.tokens_per_expert for o in rows])
        if keep_tpe
        else np.zeros((O, 0, 0), np.int16),
    )


def routing_for(trace: Trace, cost: CostModel, routing_mode: str, router_seed: int, cache: bool = True) -> np.ndarray:
    """[M, L, r] routing of every union node under the priced model ("recorded" | "synthetic")."""
    if routing_mode == "recorded":
        return trace.node_routing
    L, E, r = cost.routing_shape
    key = hashlib.sha256(json.dumps([trace.digest, L, E, r, router_seed, TABLES_VERSION]).encode()).hexdigest()[:16]
    path = cache_dir() / "replay" / f"routing-{key}.npy"
    if cache and path.is_file():
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            pass
    ids = synthetic_routing(trace, NodeRouter(E, r, L, seed=router_seed))
    if cache:
        buf = io.BytesIO()
        np.save(buf, ids)
        atomic_write_bytes(path, buf.getvalue())
    return ids


def tables_key(trace: Trace, grid: ActionGrid, cost: CostModel, routing_mode: str, router_seed: int,
               acceptance: AcceptanceModel | None = None) -> str:  # fmt: skip
    blob = [
        TABLES_VERSION,
        trace.digest,
        grid.to_dict(),
        cost.name,
        getattr(cost, "params", None),
        routing_mode,
        router_seed,
    ]
    if grid.needs_acceptance and acceptance is not None:  # grids without the rule keep their cached tables
        blob.append(acceptance.digest)
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


_LOADED: weakref.WeakValueDictionary[str, ReplayTables] = weakref.WeakValueDictionary()  # cache file -> its tables


def load_or_build_tables(
    trace: Trace,
    grid: ActionGrid,
    cost: CostModel,
    routing_mode: str,
    router_seed: int = 0,
    cache: bool = True,
    on_position: Callable[[], None] | None = None,
    acceptance: AcceptanceModel | None = None,
) -> ReplayTables:
    """Tables from the cache, else built (and cached when `cache`). routing_mode: "recorded" | "synthetic"."""
    if acceptance is None and grid.needs_acceptance:
        raise ValueError("the grid has the 'calibrated' verification rule: pass its acceptance model "
                         "(env.calibration.fit_acceptance)")  # fmt: skip
    key = tables_key(trace, grid, cost, routing_mode, router_seed, acceptance)
    path = cache_dir() / "replay" / f"tables-{key}.npz"
    tables = _LOADED.get(str(path)) if cache else None  # one copy per process (env.shared)
    if tables is not None:
        return tables
    if cache and path.is_file():
        try:
            tables = _LOADED[str(path)] = ReplayTables.from_file(path)
            return tables
        except (OSError, ValueError, KeyError):
            pass
    routing = routing_for(trace, cost, routing_mode, router_seed, cache)
    tables = build_tables(trace, grid, cost, routing, routing_mode == "recorded", on_position, acceptance)
    if cache:
        atomic_write_bytes(path, tables.to_bytes())
        _LOADED[str(path)] = tables
    return tables
