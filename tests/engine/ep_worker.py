"""One rank of the multi-process expert-parallel tests (tests/engine/test_ep.py starts W of these).

    python tests/engine/ep_worker.py --rank 0 --world 2 --store DIR/store --out DIR --checks engine,edge_cases

Joins a gloo group through a FileStore, runs the named checks in order and writes OUT/rank{R}.json
({check: "ok" or a traceback}). It stops at the first failing check: the other ranks' collective
sequence is then out of step and they fail too (gloo timeout), never hang past the test's watchdog.

Shape letters: T=local tokens r=top-r D=hidden E=experts W=ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from hf_configs import tiny_config  # this file's folder is sys.path[0] when run as a script

import engine
from engine.models.checkpoint import build_model, init_weights
from engine.parallel.ep import EPGroup, ExpertParallel, shard_model
from engine.parallel.placement import ExpertPlacement, place_experts
from kernels import fused_moe_ref

NUM_EXPERTS = 8
# three layers, the middle one dense: MoE layer indices 0 and 2
CONFIG = tiny_config("qwen2_moe", num_experts=NUM_EXPERTS, num_hidden_layers=3, mlp_only_layers=[1])
EXPERT_COUNTS = [float((NUM_EXPERTS - e) ** 2) for e in range(NUM_EXPERTS)]  # skewed: expert 0 hottest


class Ctx:
    """This rank's identity and the topology used by every check (2 ranks per node)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.ranks_per_node = 2 if world >= 4 else 1


def make_model() -> engine.Model:
    """The same tiny qwen2_moe on every rank; std 0.2 gives sharp logits (no greedy near-ties)."""
    return init_weights(build_model(CONFIG, seed=0), seed=0, std=0.2)


def placement_for(ctx: Ctx, strategy: str) -> ExpertPlacement:
    if strategy == "custom":  # replicas across nodes: exercises "this rank, else this node"
        ranks = [(e % ctx.world,) for e in range(NUM_EXPERTS)]
        ranks[0] = tuple(range(ctx.world)) if ctx.world < 4 else (1, 2)
        ranks[1] = (0, ctx.world - 1)
        return ExpertPlacement(NUM_EXPERTS, ctx.world, ctx.ranks_per_node, tuple(ranks))
    return place_experts(
        NUM_EXPERTS,
        ctx.world,
        strategy,
        ranks_per_node=ctx.ranks_per_node,
        expert_counts=EXPERT_COUNTS,
        num_replicated=2 if strategy == "replicated" else 0,
    )


def sharded(ctx: Ctx, strategy: str, debug: bool = False, drop_remote: bool = True):
    model = make_model()
    group = EPGroup(ctx.rank, ctx.world, placement_for(ctx, strategy), ctx.ranks_per_node, debug=debug)
    return model, shard_model(model, group, drop_remote=drop_remote)


def expected_serving(e: int, src: int, placement: ExpertPlacement) -> int:
    """Independent statement of the dispatch rule for the placements used here (unique choices only)."""
    ranks = placement.expert_ranks[e]
    if len(ranks) == 1 or src in ranks:
        return ranks[0] if len(ranks) == 1 else src
    near = [w for w in ranks if placement.node_of(w) == placement.node_of(src)]
    assert len(near) == 1, "test placements keep the replica choice unique"
    return near[0]


def routing(src: int, T: int, seed: int, r: int, experts: list[int] | None = None):
    """Deterministic per-source routing: distinct expert ids [T, r] from `experts`, weights [T, r]."""
    g = torch.Generator().manual_seed(1000 * seed + src)
    pool = torch.tensor(experts if experts is not None else list(range(NUM_EXPERTS)))
    ids = pool[torch.rand(T, len(pool), generator=g).argsort(1)[:, :r]]
    return ids, torch.rand(T, r, generator=g)


def _call_layers(ep: ExpertParallel, ref: engine.Model, hidden, ids, weights) -> None:
    """Run every MoE layer's fn (in order) and compare with full-weight local compute."""
    ref_blocks = ref.moe_blocks
    for fn, rb in zip(ep.fns, ref_blocks):
        b = fn.block
        out = fn(hidden, b.experts.gate_up_proj, b.experts.down_proj, ids, weights)
        assert out.shape == hidden.shape, (out.shape, hidden.shape)
        want = fused_moe_ref(hidden, rb.experts.gate_up_proj, rb.experts.down_proj, ids, weights)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------- checks
def prompts_for(rank: int) -> tuple[list[list[int]], int]:
    """Rank 0: one 1-token prompt (nothing to prefill) and 3 new tokens (finishes first, then idles).
    Rank w > 0: w + 1 prompts of different lengths with repeats (the n-gram drafter finds matches)."""
    if rank == 0:
        return [[17]], 3
    g = torch.Generator().manual_seed(100 + rank)
    prompts = []
    for i in range(rank + 1):
        base = torch.randint(2, 97, (2 + 3 * i + rank,), generator=g).tolist()
        prompts.append(base + base[: 1 + i])
    return prompts, 6 + 2 * rank


def _reference(ctx: Ctx):
    ref = make_model()
    prompts, max_new = prompts_for(ctx.rank)
    tokens = [r.token_ids for r in engine.Engine(ref).generate(prompts, max_new)]
    ids = torch.tensor([max(prompts, key=len)])
    return ref, prompts, max_new, tokens, ids, ref.logits(ids)


def check_engine(ctx: Ctx) -> None:
    """Contiguous EP greedy (target-only and n-gram speculative) == single-process; logits atol 1e-5."""
    ref, prompts, max_new, ref_tokens, ids, ref_logits = _reference(ctx)
    model, ep = sharded(ctx, "contiguous")
    held = ep.group.placements[0].rank_experts[ctx.rank]
    assert model.moe_blocks[0].experts.gate_up_proj.shape[0] == len(held)  # non-local experts dropped
    out = engine.Engine(model, ep=ep).generate(prompts, max_new)
    assert [r.token_ids for r in out] == ref_tokens, ([r.token_ids for r in out], ref_tokens)
    torch.testing.assert_close(model.logits(ids), ref_logits, atol=1e-5, rtol=0)
    spec = engine.SpecConfig(depth=3, width=2)
    out = engine.Engine(model, drafter="ngram", ep=ep).generate(prompts, max_new, spec=spec)
    assert [r.token_ids for r in out] == ref_tokens


def check_placements(ctx: Ctx) -> None:
    """round_robin, load_balanced, replicated (and weights kept) give the single-process tokens."""
    _, prompts, max_new, ref_tokens, ids, ref_logits = _reference(ctx)
    for strategy, drop in [
        ("round_robin", True),
        ("load_balanced", True),
        ("replicated", True),
        ("custom", False),
    ]:
        model, ep = sharded(ctx, strategy, drop_remote=drop)
        out = engine.Engine(model, ep=ep).generate(prompts, max_new)
        assert [r.token_ids for r in out] == ref_tokens, strategy
        torch.testing.assert_close(model.logits(ids), ref_logits, atol=1e-5, rtol=0)


def check_provenance(ctx: Ctx) -> None:
    """Rows carry (source rank + token/1000): each rank receives exactly the rows the placement sends it."""
    ref = make_model()
    for strategy in ("contiguous", "round_robin", "custom"):
        model, ep = sharded(ctx, strategy, debug=True)
        placement = ep.group.placements[0]
        r, D = model.config.top_r, model.config.hidden_size
        for step in range(2):
            T = 3 + 4 * ctx.rank
            ids, w = routing(ctx.rank, T, step, r)
            hidden = float(ctx.rank) + torch.arange(T, dtype=torch.float32)[:, None].expand(T, D) / 1000
            _call_layers(ep, ref, hidden, ids, w)
            for rec, fn in zip(ep.records[-len(ep.fns) :], ep.fns):
                assert rec.layer == fn.layer
                got = rec.expert_ids[rec.expert_ids >= 0]
                assert all(ctx.rank in placement.expert_ranks[e] for e in got.tolist()), strategy
                for src in range(ctx.world):
                    src_ids, _ = routing(src, 3 + 4 * src, step, r)
                    serve = torch.tensor(
                        [[expected_serving(e, src, placement) for e in row] for row in src_ids.tolist()]
                    )
                    mine = serve == ctx.rank  # [T_src, r]
                    tokens = mine.any(1).nonzero().squeeze(1)
                    rows = rec.source_ranks == src
                    assert int(rows.sum()) == len(tokens), (strategy, src)
                    want_payload = src + tokens.float() / 1000
                    torch.testing.assert_close(rec.hidden[rows, 0], want_payload, atol=1e-6, rtol=0)
                    want_ids = torch.where(mine[tokens], src_ids[tokens], -1)
                    assert torch.equal(rec.expert_ids[rows], want_ids), (strategy, src)
        if strategy == "custom" and ctx.world == 4:  # expert 0 on ranks (1, 2): node-local replica
            rec = ep.records[-1]
            zero_from = rec.source_ranks[(rec.expert_ids == 0).any(1)].unique().tolist()
            assert set(zero_from) <= set({1: [0, 1], 2: [2, 3]}.get(ctx.rank, [])), zero_from


def check_edge_cases(ctx: Ctx) -> None:
    """Zero tokens, very unequal counts, all ranks idle, and all-remote routing: right shapes and values."""
    ref = make_model()
    model, ep = sharded(ctx, "contiguous", debug=True)
    r, D = model.config.top_r, model.config.hidden_size
    placement = ep.group.placements[0]
    scenarios = [
        [0] * ctx.world,
        [0] + [5] * (ctx.world - 1),
        [1, 300, 0, 17][: ctx.world],
        [300] + [0] * (ctx.world - 1),
    ]
    for k, counts in enumerate(scenarios):
        T = counts[ctx.rank]
        ids, w = routing(ctx.rank, T, 10 + k, r)
        _call_layers(ep, ref, torch.randn(T, D), ids, w)
    ep.idle_step()  # everyone idle at once
    assert not ep.any_active(False)
    # all-remote: every rank routes only to experts held elsewhere
    remote = [e for e in range(NUM_EXPERTS) if ctx.rank not in placement.expert_ranks[e]]
    ep.reset_stats()
    ids, w = routing(ctx.rank, 9, 20, r, remote)
    _call_layers(ep, ref, torch.randn(9, D), ids, w)
    for rec in ep.records:
        assert not bool((rec.source_ranks == ctx.rank).any()) and rec.send_counts[ctx.rank] == 0


def check_random_steps(ctx: Ctx) -> None:
    """100 lockstep steps with random per-rank token counts (0 included): no hang, exact values."""
    ref = make_model()
    model, ep = sharded(ctx, "replicated")
    r, D = model.config.top_r, model.config.hidden_size
    sent = 0
    for step in range(100):
        g = torch.Generator().manual_seed(step)
        counts = [int(torch.randint(1, 8, (1,), generator=g)) for _ in range(ctx.world)]
        counts = [0 if float(torch.rand(1, generator=g)) < 0.3 else c for c in counts]
        T = counts[ctx.rank]
        assert ep.any_active(T > 0) == any(counts)
        if not any(counts):
            continue
        if T == 0:
            ep.idle_step()
            continue
        ids, w = routing(ctx.rank, T, 50 + step, r)
        _call_layers(ep, ref, torch.randn(T, D), ids, w)
        sent += T * r * len(ep.fns)
    totals = torch.tensor([sent, sum(ep.loads())])
    dist.all_reduce(totals)
    assert totals[0] == totals[1], totals.tolist()  # every assignment computed exactly once


CHECKS: dict[str, Callable[[Ctx], None]] = {
    "engine": check_engine,
    "placements": check_placements,
    "provenance": check_provenance,
    "edge_cases": check_edge_cases,
    "random_steps": check_random_steps,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", default=",".join(CHECKS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=30))
    ctx = Ctx(args.rank, args.world)
    results: dict[str, str] = {}
    out = Path(args.out) / f"rank{args.rank}.json"
    for name in args.checks.split(","):
        torch.manual_seed(1234 + args.rank)  # randn inputs differ per rank, reproducibly
        try:
            CHECKS[name](ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            out.write_text(json.dumps(results))
            sys.exit(1)
    out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
