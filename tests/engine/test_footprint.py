"""round_footprint (engine.runtime.footprint): its C++ call and its numpy twin equal a per-layer reference."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.footprint import footprint_numpy, round_footprint
from kernels import cpu_decode

NATIVE = pytest.mark.skipif(cpu_decode.load() is None, reason=f"fused CPU decode ops {cpu_decode.status()}")


def _reference(ids: list[torch.Tensor], E: int, prev: torch.Tensor | None):
    counts = torch.stack([torch.bincount(e.reshape(-1), minlength=E) for e in ids])
    pairs = counts > 0
    n = ids[0].shape[0]
    root = sum(int(torch.unique(e[0]).numel()) for e in ids)
    new = (int(pairs.sum()) - root) / (n - 1) if n > 1 else 0.0
    overlap = None if prev is None else float((pairs & prev).sum()) / max(int(pairs.sum()), 1)
    return counts, pairs.sum(1).tolist(), new, overlap


def _routing(n: int, L: int, E: int, r: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=gen)[:r] for _ in range(n)]) for _ in range(L)]  # L x [n, r]


IMPLS = [pytest.param(round_footprint, id="round_footprint", marks=NATIVE), pytest.param(footprint_numpy, id="numpy")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_prev", [True, False])
@pytest.mark.parametrize("n,L,E,r", [(1, 3, 8, 2), (5, 4, 16, 2), (17, 6, 64, 8), (3, 48, 128, 8)])
def test_round_footprint_equals_the_per_layer_reference(impl, with_prev, n, L, E, r):
    ids = _routing(n, L, E, r, n * L)
    prev = torch.rand(L, E, generator=torch.Generator().manual_seed(L)) < 0.2 if with_prev else None
    fp = impl(ids, E, prev)
    counts, distinct, new, overlap = _reference(ids, E, prev)
    assert torch.equal(fp.tokens_per_expert, counts) and fp.distinct_experts == distinct
    assert torch.equal(fp.pairs, counts > 0)
    assert fp.new_pairs_per_node == pytest.approx(new)
    assert (fp.overlap_prev is None) == (prev is None) and fp.overlap_prev == pytest.approx(overlap)
    assert fp.reuse == pytest.approx(1 - sum(distinct) / (n * L * r))


@NATIVE
def test_the_native_call_takes_a_batched_forwards_rows():
    """rows=(start, n) of a whole step's routing equals the footprint of those rows sliced out (the engine's call),
    and the C++ call is what runs (not the numpy twin)."""
    ids, prev = _routing(12, 4, 16, 2, 3), torch.rand(4, 16, generator=torch.Generator().manual_seed(0)) < 0.3
    assert cpu_decode.routing_footprint(ids, 5, 4, 16, prev) is not None
    a = round_footprint(ids, 16, prev, rows=(5, 4))
    b = footprint_numpy([e[5:9] for e in ids], 16, prev)
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert) and a.distinct_experts == b.distinct_experts
    assert (a.reuse, a.overlap_prev, a.new_pairs_per_node) == pytest.approx((b.reuse, b.overlap_prev,
                                                                            b.new_pairs_per_node))  # fmt: skip


@NATIVE
def test_the_native_call_leaves_other_layouts_to_numpy():
    ids = _routing(4, 3, 8, 2, 1)
    for other in ([e.int() for e in ids], [e.t().contiguous().t() for e in ids]):  # int32; not contiguous
        assert cpu_decode.routing_footprint(other, 0, 4, 8, None) is None
        assert round_footprint(other, 8, None).distinct_experts == footprint_numpy(ids, 8, None).distinct_experts
    assert cpu_decode.routing_footprint(ids, 0, 4, 8, torch.zeros(3, 8)) is None  # prev not bool
    with pytest.raises(ValueError, match="past the routing"):
        cpu_decode.routing_footprint(ids, 2, 4, 8, None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [-1, 4])
def test_round_footprint_refuses_ids_outside_the_experts(impl, bad):
    with pytest.raises(ValueError, match=r"expert id -?\d+ outside \[0, 4\)"):
        impl([torch.tensor([[0, bad]])], 4, None)


def test_round_footprint_takes_the_stacked_routing_too():
    gen = torch.Generator().manual_seed(1)
    ids = [torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(6)]) for _ in range(5)]  # L x [n, r]
    a, b = round_footprint(ids, 32, None), round_footprint(torch.stack(ids, 1), 32, None)
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert) and a.new_pairs_per_node == b.new_pairs_per_node
