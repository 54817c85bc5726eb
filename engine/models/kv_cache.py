"""Paged KV cache: fixed-size blocks, a free list, per-sequence block tables, scratch slots for trees.

    storage  k[layer] : [num_blocks * block_size, Hkv, hd]      slot = block * block_size + offset
             v[layer] : [num_blocks * block_size, Hkv, hd_v]    (hd_v = 0 for MLA: k holds the latent)
             positions: [num_blocks * block_size]               token position of each slot (sliding windows)
    sequence          : block table [b0, b7, b3, ...]  -> position p lives in slot table[p // bs] * bs + p % bs

    committed positions 0 .. n-1   (verified tokens only)
    scratch blocks      per round  (draft-tree nodes; released when the round commits)

A round writes its tree nodes into scratch slots, verifies, copies the accepted path's K/V to the
committed positions and releases every scratch block, so at quiescence all blocks are free and no
slot read by a later forward holds an unverified token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCacheFull(RuntimeError):
    """No free block left: lower the batch size or max tokens, or raise num_blocks."""


@dataclass
class SequenceBlocks:
    """Block table of one sequence (its committed length is the caller's: positions are reserved on demand).

    table [len(blocks) * block_size]: the slot of every reserved position, extended with the blocks (`slots` of a
    range returns a view of it: no per-call index arithmetic)."""

    blocks: list[int] = field(default_factory=list)
    table: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class PagedKVCache:
    """K/V storage for every layer of one model plus a block allocator."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.v = torch.zeros(shape[:-1] + (v_dim,), dtype=dtype, device=device)
        self.positions = torch.zeros(num_blocks * block_size, dtype=torch.long, device=device)  # written on demand
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.seqs: dict[int, SequenceBlocks] = {}
        self.scratch: dict[int, list[int]] = {}
        self.pad_block: int | None = None  # held by CUDA-graph padding (engine.models.cuda_graphs)

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> PagedKVCache:  # fmt: skip
        """A cache shaped by a `ModelConfig`'s `kv_cache_layout` (MLA: one compressed latent per token)."""
        heads, k_dim, v_dim = cfg.kv_cache_layout
        return cls(cfg.num_layers, heads, k_dim, num_blocks, block_size, dtype, device, v_head_dim=v_dim)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies over all layers (K and V)."""
        L, _, H, dk = self.k.shape
        return L * H * (dk + self.v.shape[-1]) * self.k.element_size()

    # ------------------------------------------------------------------ allocation
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise KVCacheFull(f"KV cache needs {n} more blocks but only {len(self.free)} are free")
        return [self.free.pop() for _ in range(n)]

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already has KV blocks")
        self.seqs[seq_id] = SequenceBlocks()

    def reserve(self, seq_id: int, length: int) -> None:
        """Make sure the block table covers positions 0 .. length-1."""
        seq = self.seqs[seq_id]
        need = -(-length // self.block_size) - len(seq.blocks)
        if need > 0:
            new = self._take(need)
            seq.blocks.extend(new)
            seq.table = torch.cat([seq.table, self._block_slots(new)])

    def release(self, seq_id: int) -> None:
        """Return every block of a finished sequence (and any scratch) to the free list."""
        seq = self.seqs.pop(seq_id)
        self.free.extend(reversed(seq.blocks))
        self.release_scratch(seq_id)

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.block_size)

    # ------------------------------------------------------------------ slots
    def _block_slots(self, blocks: list[int]) -> torch.Tensor:
        """Every slot of these blocks, in order -> LongTensor [len(blocks) * block_size]."""
        bs = self.block_size
        return (torch.tensor(blocks, dtype=torch.long)[:, None] * bs + torch.arange(bs)).reshape(-1)

    def slots(self, seq_id: int, positions: torch.Tensor | range | list[int]) -> torch.Tensor:
        """Cache slots of committed positions of a sequence -> LongTensor [len(positions)] (for a step-1 range, a
        read-only view of the sequence's slot table)."""
        seq = self.seqs[seq_id]
        if isinstance(positions, range) and positions.step == 1 and positions.start >= 0:
            if positions.stop > seq.table.shape[0] and len(positions):
                raise IndexError(f"position {positions.stop - 1} beyond the reserved blocks of sequence {seq_id}")
            return seq.table[positions.start : max(positions.start, positions.stop)]
        pos = torch.as_tensor(list(positions) if isinstance(positions, range) else positions, dtype=torch.long)
        if pos.numel() and int(pos.max()) >= len(seq.blocks) * self.block_size:
            raise IndexError(f"position {int(pos.max())} beyond the reserved blocks of sequence {seq_id}")
        table = torch.tensor(seq.blocks, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def scratch_slots(self, seq_id: int, n: int) -> torch.Tensor:
        """Allocate scratch blocks for n unverified tree nodes -> LongTensor [n] of slots."""
        blocks = self._take(self.blocks_needed(n))
        self.scratch.setdefault(seq_id, []).extend(blocks)
        bs = self.block_size
        return torch.tensor([b * bs + i for b in blocks for i in range(bs)][:n], dtype=torch.long)

    def hold_pad_block(self) -> int:
        """Take one block out of circulation for padding tokens' writes (idempotent) -> its block id."""
        if self.pad_block is None:
            self.pad_block = self._take(1)[0]
        return self.pad_block

    def release_scratch(self, seq_id: int) -> None:
        blocks = self.scratch.pop(seq_id, [])
        self.free.extend(reversed(blocks))

    # ------------------------------------------------------------------ data
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [N]; k, v [N, Hkv, hd]."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def write_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """slots [N] hold tokens at positions [N] (read back by sliding-window attention)."""
        self.positions.index_copy_(0, slots, positions.to(self.positions.device))

    def read(self, layer: int, slots: torch.Tensor, start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [B, S] -> k, v [B, S, Hkv, hd]. start: when B = 1 and the slots are the run start .. start+S-1
        (`ForwardBatch.read_start`), views of the storage instead of a gathered copy of the context."""
        if start is not None:
            S = slots.shape[1]
            return self.k[layer, start : start + S].unsqueeze(0), self.v[layer, start : start + S].unsqueeze(0)
        return self.k[layer][slots], self.v[layer][slots]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of every layer from slots src [n] to slots dst [n] (accepted path -> committed)."""
        if src.numel():
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
            self.positions[dst] = self.positions[src]

    def check_quiescent(self) -> None:
        """Raise if any block is still held (the invariant at the end of `Engine.generate`)."""
        held = 0 if self.pad_block is None else 1
        if self.seqs or self.scratch or len(self.free) + held != self.num_blocks:
            raise AssertionError(
                f"KV leak: {self.num_blocks - len(self.free) - held} blocks held by {sorted(self.seqs)} "
                f"and scratch {sorted(self.scratch)}"
            )
        if len(set(self.free) | ({self.pad_block} if held else set())) != self.num_blocks:
            raise AssertionError("KV free list holds a block twice")
