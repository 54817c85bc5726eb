"""The paged cache's slot arithmetic and the drafter's expansion mask, against their direct formulations."""

from __future__ import annotations

import random

import pytest
import torch

from engine.models.batching import expansion_item
from engine.models.kv_cache import PagedKVCache
from engine.spec.draft_tree import ancestor_mask


def _direct_slots(kv: PagedKVCache, seq_id: int, positions: list[int]) -> list[int]:
    blocks = kv.seqs[seq_id].blocks
    return [blocks[p // kv.block_size] * kv.block_size + p % kv.block_size for p in positions]


def test_slot_table_follows_the_block_table_as_it_grows() -> None:
    kv = PagedKVCache(1, 1, 4, num_blocks=20, block_size=4)
    kv.add_sequence(0)
    kv.add_sequence(1)
    for length in (3, 9, 10, 17, 30):  # interleaved growth: the two sequences' blocks are not contiguous
        for s in (0, 1):
            kv.reserve(s, length)
            assert kv.slots(s, range(length)).tolist() == _direct_slots(kv, s, list(range(length)))
            assert kv.slots(s, range(2, length - 1)).tolist() == _direct_slots(kv, s, list(range(2, length - 1)))
            assert kv.slots(s, [length - 1, 0]).tolist() == _direct_slots(kv, s, [length - 1, 0])
    assert kv.slots(0, range(0)).numel() == 0
    with pytest.raises(IndexError, match="beyond the reserved blocks"):
        kv.slots(0, range(33))
    scratch = kv.scratch_slots(0, 6)
    assert scratch.tolist() == [b * 4 + i for b in kv.scratch[0] for i in range(4)][:6]
    kv.release(0)
    kv.release(1)
    kv.check_quiescent()


def test_expansion_mask_is_the_ancestor_mask_restricted_to_the_fed_nodes() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 40)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        fed = {i: 100 + i for i in rng.sample(range(1, n), rng.randint(1, n - 1))}
        nodes = sorted(rng.sample(sorted(fed), rng.randint(1, len(fed))))
        ctx = torch.arange(rng.randint(1, 5))
        item = expansion_item(nodes, list(range(n)), parents, depths, ctx, fed)
        order = sorted(fed)
        want = ancestor_mask(torch.tensor(parents))[torch.tensor(nodes)][:, torch.tensor(order)]
        assert torch.equal(item.mask[:, : ctx.shape[0]], torch.ones(len(nodes), ctx.shape[0], dtype=torch.bool))
        assert torch.equal(item.mask[:, ctx.shape[0] :], want)
        assert item.read_slots.tolist() == ctx.tolist() + [fed[i] for i in order]
