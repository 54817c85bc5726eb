"""Routing alignment for the MoE grouped GEMM: expert-sorted, block-padded assignment order.

An *assignment* is one (token t, slot s) pair of the router's top-r choice; its flat index is
t * r + s. The grouped GEMM processes assignments in tiles of BLOCK_M rows that all belong to one
expert, so each expert's assignments are listed contiguously and padded up to a multiple of BLOCK_M
(the idea of vLLM's `moe_align_block_size`). Expert id -1 marks an expert that is not local to this
rank under expert parallelism (EP): such assignments are skipped and contribute nothing.

    expert_ids [T=3, r=2]  = [[2, 0], [2, -1], [0, 2]]          BLOCK_M = 4, E = 3
    flat index                 0  1    2   3     4  5

    sorted_ids   | 1 4 S S | 0 2 5 S |  S S S S ...            S = sentinel T*r = 6
                 | expert 0| expert 2|  unused (-1)
    expert_counts  [2, 0, 3]           expert 1 has no tokens: it owns no block
    expert_offsets [0, 4, 4, 8]        block-padded, [E+1]
    num_padded     8

Buffers are sized for the worst case, P = cdiv(T*r + min(E, T*r) * (BLOCK_M - 1), BLOCK_M) * BLOCK_M,
so the Triton twin never syncs with the host; blocks past `num_padded` have expert id -1.
Within an expert, assignments keep their flat order (stable), so both twins agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._launch import launch

# E=experts T=tokens r=top-r A=assignments (T*r) P=padded length (worst case) NB=blocks (P / BLOCK_M)


@dataclass
class MoeAlignment:
    """Expert-sorted, block-padded assignment order (all int32, on the device of `expert_ids`)."""

    sorted_ids: torch.Tensor  # [P] flat assignment index t*r+s, sentinel A in padding
    block_expert_ids: torch.Tensor  # [NB] expert of each BLOCK_M block, -1 for an unused block
    expert_counts: torch.Tensor  # [E] valid assignments per expert (zero-token experts included)
    expert_offsets: torch.Tensor  # [E+1] block-padded start of each expert in sorted_ids
    num_padded: torch.Tensor  # [] total padded length == expert_offsets[-1]
    block_size: int


def max_padded_len(num_assign: int, num_experts: int, block_size: int) -> int:
    """Worst-case padded length P for `num_assign` assignments (a multiple of `block_size`)."""
    worst = num_assign + min(num_experts, num_assign) * (block_size - 1)
    return triton.cdiv(worst, block_size) * block_size


def check_expert_ids(expert_ids: torch.Tensor, num_experts: int, check_values: bool = True) -> None:
    """Raise ValueError unless `expert_ids` is [T, r] int32/int64 with values in [-1, E).

    `check_values=False` skips the value range (a host sync on CUDA); `moe_align` then checks it on
    the device instead.
    """
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [T, r], got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not check_values or expert_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(expert_ids))  # one pass, one sync
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"expert_ids must lie in [-1, {num_experts}) (-1 = expert not local), got min {lo}, max {hi}")


def moe_align_ref(expert_ids: torch.Tensor, num_experts: int, block_size: int) -> MoeAlignment:
    """Pure-torch spec: expert_ids [T, r] (-1 = skip) -> MoeAlignment for tiles of `block_size`."""
    check_expert_ids(expert_ids, num_experts)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()  # [A]
    num_assign = flat.numel()
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)  # [E]
    padded = (counts + block_size - 1) // block_size * block_size
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(padded, 0)

    # stable sort by expert; invalid assignments get key E and fall off the end
    key = torch.where(valid, flat, num_experts)
    order = torch.argsort(key, stable=True)[: int(valid.sum())]  # [A_valid]
    sorted_expert = key[order]
    starts_unpadded = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=device) - starts_unpadded[sorted_expert]
    pos = offsets[sorted_expert] + rank

    total_len = max_padded_len(num_assign, num_experts, block_size)
    sorted_ids = torch.full((total_len,), num_assign, dtype=torch.int32, device=device)
    sorted_ids[pos] = order.to(torch.int32)

    block_start = torch.arange(0, total_len, block_size, device=device)  # [NB]
    block_expert = torch.searchsorted(offsets[1:], block_start, right=True)
    block_expert = torch.where(block_start < offsets[-1], block_expert, -1)
    return MoeAlignment(
        sorted_ids=sorted_ids,
        block_expert_ids=block_expert.to(torch.int32),
        expert_counts=counts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
        num_padded=offsets[-1].to(torch.int32),
        block_size=block_size,
    )


@triton.jit
def _moe_align_kernel(
    expert_ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    counts_ptr,
    offsets_ptr,
    num_padded_ptr,
    num_invalid_ptr,
    num_assign,
    num_experts,
    total_len,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    # One program: decode-sized routing has a few hundred assignments, so a single CTA that sweeps
    # them in CHUNK-sized pieces beats a multi-kernel scan and needs no atomics (deterministic).
    experts = tl.arange(0, E_PAD)
    lane = tl.arange(0, CHUNK)

    # phase 1: per-expert counts (one-hot sums; -1 and padding lanes match no expert). Ids outside
    # [-1, E) are counted as invalid and otherwise skipped, so no weight is read out of bounds.
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    invalid = tl.zeros((CHUNK,), dtype=tl.int32)
    for c0 in range(0, num_assign, CHUNK):
        idx = c0 + lane
        ids = tl.load(expert_ids_ptr + idx, mask=idx < num_assign, other=-1).to(tl.int32)
        invalid += ((ids < -1) | (ids >= num_experts)).to(tl.int32)
        ids = tl.where(ids < num_experts, ids, -1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(num_invalid_ptr, tl.sum(invalid, axis=0))

    # phase 2: block-padded offsets, total, and the expert owning each block
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] inclusive
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    e_mask = experts < num_experts
    tl.store(counts_ptr + experts, counts, mask=e_mask)
    tl.store(offsets_ptr + 1 + experts, ends, mask=e_mask)
    tl.store(offsets_ptr + experts, starts, mask=experts == 0)
    tl.store(num_padded_ptr, total)
    for p0 in range(0, total_len, CHUNK * BLOCK_M):
        blk = p0 // BLOCK_M + lane
        blk_start = blk * BLOCK_M
        # expert(p) = #experts whose padded segment ends at or before p (zero-length ones included)
        owner = tl.sum((ends[None, :] <= blk_start[:, None]).to(tl.int32), axis=1)
        owner = tl.where(blk_start < total, owner, -1)
        tl.store(block_expert_ptr + blk, owner, mask=blk_start < total_len)
    for p0 in range(0, total_len, FILL):
        pos = p0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + pos, tl.zeros((FILL,), dtype=tl.int32) + num_assign, mask=pos < total_len)
    tl.debug_barrier()  # the sentinel fill must land before the scatter overwrites it

    # phase 3: scatter flat indices; rank inside an expert = earlier same-expert lanes + earlier chunks
    seen = tl.zeros((E_PAD,), dtype=tl.int32)  # assignments of each expert placed so far
    for c0 in range(0, num_assign, CHUNK):
        idx = c0 + lane
        ids = tl.load(expert_ids_ptr + idx, mask=idx < num_assign, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        before = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])  # [CHUNK, CHUNK]
        rank = tl.sum(before.to(tl.int32), axis=1)
        base = tl.sum(onehot * (starts + seen)[None, :], axis=1)
        tl.store(sorted_ids_ptr + base + rank, idx, mask=ids >= 0)
        seen += tl.sum(onehot, axis=0)


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_size: int) -> MoeAlignment:
    """Triton twin of `moe_align_ref` (same outputs, bit for bit). expert_ids [T, r] int32/int64.

    On CUDA the value range is checked on the device (ids outside [-1, E) are skipped and trip a
    `torch._assert_async`), so the launch needs no host sync and can be graph-captured.
    """
    check_expert_ids(expert_ids, num_experts, check_values=not expert_ids.is_cuda)
    if not expert_ids.is_contiguous():
        raise ValueError("expert_ids must be contiguous")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    device = expert_ids.device
    num_assign = expert_ids.numel()
    if num_assign == 0:
        return moe_align_ref(expert_ids, num_experts, block_size)
    total_len = max_padded_len(num_assign, num_experts, block_size)
    sorted_ids = torch.empty(total_len, dtype=torch.int32, device=device)
    block_expert = torch.empty(total_len // block_size, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    num_padded = torch.empty((), dtype=torch.int32, device=device)
    num_invalid = torch.empty((), dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    launch(
        _moe_align_kernel,
        (1,),
        expert_ids,
        sorted_ids,
        block_expert,
        counts,
        offsets,
        num_padded,
        num_invalid,
        num_assign,
        num_experts,
        total_len,
        BLOCK_M=block_size,
        E_PAD=e_pad,
        CHUNK=max(16, min(128, 8192 // e_pad)),
        FILL=1024,
        num_warps=4,
    )
    if expert_ids.is_cuda:
        torch._assert_async(num_invalid == 0, "moe_align: expert_ids outside [-1, num_experts)")
    return MoeAlignment(sorted_ids, block_expert, counts, offsets, num_padded, block_size)
