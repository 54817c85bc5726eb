"""CUDA-graph buckets (engine.models.cuda_graphs): the padding is exact on CPU; replay == eager on a GPU."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.models.batching import chain_item, pack, tree_item
from engine.models.cuda_graphs import GraphBuckets, GraphedForward
from engine.models.kv_cache import PagedKVCache
from engine.workloads import code_prompts, encode, prose_prompts
from engine.zoo.build import zoo_path


@pytest.fixture(scope="module")
def zoo():
    target = engine.load_model(zoo_path("tiny-moe"))
    drafter = engine.load_model(zoo_path("tiny-dense"))
    prompts = encode(target.tokenizer, code_prompts(2) + prose_prompts(2), 40)
    return target, drafter, prompts


def _cache(model, tokens: int) -> PagedKVCache:
    return PagedKVCache.for_model(model.config, -(-tokens // 8) + 4, 8, model.dtype, model.device)


@torch.inference_mode()
def test_padded_bucket_forward_equals_the_plain_forward(zoo):
    target, _, prompts = zoo
    kv = _cache(target, 200)
    runner = GraphedForward(target, kv, GraphBuckets(batch=(4,), query=(8,), tokens=(16,), keys=(64,)))
    items = []
    for i, p in enumerate(prompts[:3]):
        kv.add_sequence(i)
        kv.reserve(i, len(p) + 8)
        slots = kv.slots(i, range(len(p) + 8))
        target.forward_batch(pack([chain_item(p, slots[:0], slots[: len(p)])], target.device), kv)
        if i == 1:  # a draft tree of 4 nodes
            tree = torch.tensor([3, 4, 5, 6]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2])
            items.append(tree_item(*tree, slots[: len(p)], slots[len(p) : len(p) + 4]))
        else:
            items.append(chain_item([7, 8, 9][: i + 1], slots[: len(p)], slots[len(p) : len(p) + i + 1]))
    batch = pack(items, target.device)
    ref = target.forward_batch(batch, kv)
    got = runner(batch, kv)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.hidden, ref.hidden, rtol=1e-5, atol=1e-5)
    assert runner.stats.replayed == 1 and runner.stats.eager == 0
    # padding writes only the pad block: every real slot keeps what the plain forward wrote
    assert runner(batch, kv, record_routing=True).routing is not None and runner.stats.eager == 1
    for i in range(3):
        kv.release(i)
    kv.check_quiescent()  # the pad block is accounted for


def test_engine_with_cuda_graph_buckets_gives_the_same_tokens(zoo):
    target, drafter, prompts = zoo
    plain = engine.Engine(target, drafter, instrument=False, timing=False)
    graphed = engine.Engine(target, drafter, instrument=False, timing=False, cuda_graphs=True)
    for spec in (None, engine.SpecConfig(depth=3), engine.SpecConfig(depth=2, width=2)):
        ref = [r.token_ids for r in plain.generate(prompts, 12, spec=spec)]
        assert [r.token_ids for r in graphed.generate(prompts, 12, spec=spec)] == ref
    assert graphed._graphed.stats.replayed > 0 and graphed.drafter._graphed.stats.replayed > 0
    graphed.kv.check_quiescent()


def test_cuda_graphs_refuse_ep_and_offload(zoo):
    target, _, _ = zoo
    with pytest.raises(ValueError, match="cuda_graphs"):
        engine.Engine(target, ep=object(), cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_token_for_token(zoo):
    target, drafter, prompts = zoo
    target = engine.load_model(zoo_path("tiny-moe"), device="cuda")
    drafter = engine.load_model(zoo_path("tiny-dense"), device="cuda")
    eager = engine.Engine(target, drafter, instrument=False, timing=False)
    graphed = engine.Engine(target, drafter, instrument=False, timing=False, cuda_graphs=True)
    for spec in (None, engine.SpecConfig(depth=4), engine.SpecConfig(depth=3, width=2)):
        ref = [r.token_ids for r in eager.generate(prompts, 24, spec=spec)]
        assert [r.token_ids for r in graphed.generate(prompts, 24, spec=spec)] == ref
    assert graphed._graphed.stats.captured > 0 and graphed._graphed.stats.replayed > 0
