"""moe_align (Triton, interpreter on CPU) against moe_align_ref, and the reference's invariants."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_align import MoeAlignment, max_padded_len, moe_align, moe_align_ref

# E=experts T=tokens r=top-r A=assignments (T*r)

FIELDS = ("sorted_ids", "block_expert_ids", "expert_counts", "expert_offsets", "num_padded")


def random_routing(T: int, r: int, E: int, local_frac: float = 1.0, seed: int = 0) -> torch.Tensor:
    """[T, r] distinct experts per token; a share 1 - local_frac of the slots set to -1 (EP)."""
    gen = torch.Generator().manual_seed(seed)
    expert_ids = torch.rand(T, E, generator=gen).topk(r, dim=1).indices
    remote = torch.rand(T, r, generator=gen) >= local_frac
    return expert_ids.masked_fill(remote, -1)


def check_invariants(al: MoeAlignment, expert_ids: torch.Tensor, E: int) -> None:
    """Every local (t, s) listed exactly once, inside its expert's padded segment; rest is sentinel."""
    bm = al.block_size
    flat = expert_ids.reshape(-1).long()
    A = flat.numel()
    local = (flat >= 0).nonzero().squeeze(1)
    assert al.sorted_ids.numel() == max_padded_len(A, E, bm)
    assert al.block_expert_ids.numel() * bm == al.sorted_ids.numel()
    listed = al.sorted_ids[al.sorted_ids != A].long()
    assert torch.equal(listed.sort().values, local), "each local assignment exactly once"
    assert torch.equal(al.expert_counts.long(), torch.bincount(flat[local], minlength=E))
    offsets = al.expert_offsets.long()
    assert offsets[0] == 0 and int(al.num_padded) == offsets[-1]
    assert torch.all(offsets.diff() % bm == 0) and torch.all(offsets.diff() >= al.expert_counts)
    assert torch.all(offsets.diff() < al.expert_counts + bm)
    for e in range(E):
        seg = al.sorted_ids[offsets[e] : offsets[e + 1]].long()
        real = seg[seg != A]
        assert real.numel() == al.expert_counts[e]
        assert torch.all(flat[real] == e) and torch.all(real.diff() > 0), "grouped by expert, stable"
        assert torch.all(seg[: real.numel()] != A), "padding only at the end of a segment"
    owner = al.block_expert_ids.long()
    for b in range(owner.numel()):
        start = b * bm
        if start >= int(al.num_padded):
            assert owner[b] == -1
        else:
            assert offsets[owner[b]] <= start < offsets[owner[b] + 1]


# (T, r, E, block_size, local share): every T in {1,2,7,33,64}, E in {8,16,60}, r in {1,2,4,8}
CASES = [
    (1, 1, 8, 16, 1.0),
    (2, 2, 16, 16, 1.0),
    (7, 4, 60, 16, 1.0),
    (33, 8, 8, 16, 1.0),
    (64, 8, 60, 16, 0.6),
    (64, 2, 16, 32, 0.5),
    (7, 8, 8, 4, 0.8),
    (33, 4, 60, 64, 0.3),
    (2, 1, 60, 16, 0.0),  # EP rank that owns none of the chosen experts
]


@pytest.mark.parametrize("T,r,E,block,local_frac", CASES)
def test_ref_invariants(T: int, r: int, E: int, block: int, local_frac: float) -> None:
    expert_ids = random_routing(T, r, E, local_frac, seed=T * 100 + E)
    check_invariants(moe_align_ref(expert_ids, E, block), expert_ids, E)


@pytest.mark.parametrize("T,r,E,block,local_frac", CASES)
def test_triton_matches_ref(triton_cpu: None, T: int, r: int, E: int, block: int, local_frac: float) -> None:
    expert_ids = random_routing(T, r, E, local_frac, seed=T * 100 + E)
    ref = moe_align_ref(expert_ids, E, block)
    out = moe_align(expert_ids, E, block)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    check_invariants(out, expert_ids, E)


def test_known_answer(triton_cpu: None) -> None:
    expert_ids = torch.tensor([[2, 0], [2, -1], [0, 2]])
    for fn in (moe_align_ref, moe_align):
        al = fn(expert_ids, 3, 4)
        S = 6
        assert al.sorted_ids[:8].tolist() == [1, 4, S, S, 0, 2, 5, S]
        assert torch.all(al.sorted_ids[8:] == S)
        assert al.block_expert_ids[:2].tolist() == [0, 2] and torch.all(al.block_expert_ids[2:] == -1)
        assert al.expert_counts.tolist() == [2, 0, 3]
        assert al.expert_offsets.tolist() == [0, 4, 4, 8]
        assert int(al.num_padded) == 8


def test_zero_token_experts_and_int32(triton_cpu: None) -> None:
    # all tokens on experts 3 and 11 of 16: the other 14 experts get no block at all
    expert_ids = torch.tensor([[3, 11]] * 20 + [[11, 3]] * 13, dtype=torch.int32)
    ref = moe_align_ref(expert_ids, 16, 16)
    assert ref.expert_counts.tolist() == [0] * 3 + [33] + [0] * 7 + [33] + [0] * 4
    assert int(ref.num_padded) == 2 * 48
    out = moe_align(expert_ids, 16, 16)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    check_invariants(out, expert_ids, 16)


def test_many_experts_and_chunks(triton_cpu: None) -> None:
    # E > 256 and A > CHUNK exercise the multi-chunk loops of the single-program kernel
    expert_ids = random_routing(40, 8, 300, local_frac=0.9, seed=1)
    ref, out = moe_align_ref(expert_ids, 300, 16), moe_align(expert_ids, 300, 16)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def test_empty(triton_cpu: None) -> None:
    expert_ids = torch.empty(0, 2, dtype=torch.long)
    for fn in (moe_align_ref, moe_align):
        al = fn(expert_ids, 8, 16)
        assert al.sorted_ids.numel() == 0 and int(al.num_padded) == 0
        assert al.expert_counts.tolist() == [0] * 8


@pytest.mark.parametrize("fn", [moe_align_ref, moe_align])
def test_bad_input(triton_cpu: None, fn) -> None:
    good = torch.tensor([[0, 1], [2, -1]])
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        fn(torch.tensor([[0, 4]]), 4, 16)
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        fn(torch.tensor([[0, -2]]), 4, 16)
    with pytest.raises(ValueError, match="T, r"):
        fn(good.reshape(-1), 4, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        fn(good.float(), 4, 16)
    with pytest.raises(ValueError, match="block_size"):
        fn(good, 4, 0)


def test_non_contiguous(triton_cpu: None) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        moe_align(torch.zeros(4, 6, dtype=torch.long)[:, ::2], 4, 16)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("E", [8, 16, 60])
@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_sweep(triton_cpu: None, T: int, E: int, r: int) -> None:
    expert_ids = random_routing(T, r, E, local_frac=0.8, seed=T + E + r)
    ref, out = moe_align_ref(expert_ids, E, 16), moe_align(expert_ids, E, 16)
    check_invariants(ref, expert_ids, E)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
