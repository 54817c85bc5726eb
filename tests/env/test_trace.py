"""The trace format: round trip, versioning, model digests, atomic writes; the recorded trees' invariants."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import engine
from engine.spec.config import SpecConfig
from env.trace import FORMAT_VERSION, TraceError, load_trace, save_trace


def test_round_trip_and_digest(greedy_trace, tmp_path):
    path = save_trace(greedy_trace, tmp_path / "copy.npz")
    back = load_trace(path)
    assert back.digest == greedy_trace.digest
    assert back.meta["format_version"] == FORMAT_VERSION
    for k, a in greedy_trace.arrays.items():
        assert np.array_equal(a, back.arrays[k]), k
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def _rewrite_meta(src, dst, **changes):
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays.pop("meta")).decode())
    for k, v in changes.items():
        if isinstance(v, dict):
            meta[k] = {**meta[k], **v}
        else:
            meta[k] = v
    np.savez(dst, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)


def test_other_format_version_is_refused(greedy_trace, tmp_path):
    bad = tmp_path / "old.npz"
    _rewrite_meta(greedy_trace.path, bad, format_version=FORMAT_VERSION + 1)
    with pytest.raises(TraceError, match="format version"):
        load_trace(bad)


def test_other_model_digest_is_refused(greedy_trace, tmp_path):
    with pytest.raises(TraceError, match="another target"):
        load_trace(greedy_trace.path, target_digest="0" * 16)
    with pytest.raises(TraceError, match="another drafter"):
        load_trace(greedy_trace.path, drafter_digest="f" * 16)
    (tmp_path / "junk.npz").write_bytes(b"not a trace")
    with pytest.raises(TraceError, match="not a readable"):
        load_trace(tmp_path / "junk.npz")


def test_union_trees_and_membership(greedy_trace):
    tr = greedy_trace
    nW = len(tr.widths)
    for p in range(tr.num_positions):
        sl = tr.nodes_of(p)
        par, dep, wm = tr.node_parent[sl], tr.node_depth[sl], tr.node_wmask[sl]
        assert par[0] == -1 and dep[0] == 0 and wm[0] == (1 << nW) - 1
        assert np.all(par[1:] < np.arange(1, len(par))) and np.all(dep[1:] == dep[par[1:]] + 1)
        for w in range(nW):
            order = tr.tree_order(p, w)
            assert order[0] == 0 and set(order.tolist()) == set(np.flatnonzero((wm >> w) & 1).tolist())
            assert np.all(np.diff(dep[order]) >= 0)  # depth by depth


def test_tree_k_is_the_depth_k_prefix_of_tree_kmax(zoo_models):
    """The replay's central claim about engine.drafting.tree_growth: with deterministic children (greedy, or
    position-keyed noise), growth is depth by depth, so tree(K, W) = the depth-K prefix of tree(Kmax, W)."""
    target, drafter, _ = zoo_models
    prompt = target.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number.').ids
    gen = torch.Generator().manual_seed(0)
    for params in (engine.SamplingParams(), engine.SamplingParams(temperature=0.7, seed=1, mode="position")):
        for W in (1, 2, 3):
            trees = {}
            for K in (2, 5, 8):
                trees[K] = _draft_once(target, drafter, prompt, SpecConfig(depth=K, width=W), params, gen)
            full = trees[8]
            for K in (2, 5):
                keep = (full.depths <= K).nonzero().squeeze(1)
                prefix = full.subtree(keep)
                t = trees[K]
                assert torch.equal(t.tokens, prefix.tokens) and torch.equal(t.parents, prefix.parents)
                assert torch.allclose(t.path_prob, prefix.path_prob, rtol=1e-5)
                assert t.confidence == pytest.approx(full.confidence[:K], rel=1e-5)


def _draft_once(target, drafter, prompt, spec, params, gen):
    """One drafting round on a fresh drafter sequence (the engine's start: the prompt's target features)."""
    from engine.models.batching import chain_item, pack
    from engine.models.kv_cache import PagedKVCache

    cfg = target.config
    kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 16, target.dtype, target.device)
    kv.add_sequence(0)
    kv.reserve(0, len(prompt))
    slots = kv.slots(0, range(len(prompt) - 1))
    with torch.inference_mode():
        hidden = target.forward_batch(pack([chain_item(prompt[:-1], slots[:0], slots)], target.device), kv).hidden
        drafter.prepare([len(prompt) + 16])
        drafter.start(0, prompt, target_hidden=hidden)
        try:
            return drafter.draft_many([(0, prompt, spec, params, gen)])[0]
        finally:
            drafter.finish(0)
