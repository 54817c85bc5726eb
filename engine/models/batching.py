"""Pack several requests' new tokens into one `ForwardBatch` over the paged KV cache.

Each `PackItem` says which tokens to run, where their K/V go, which slots they may read and which
of those each token sees. Prefill (causal chain), plain decode (one token), tree verification and
drafter tree expansion are all the same call with different masks.

Shape letters: B=requests n=new tokens of one request S=readable slots N=packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.transformer import ForwardBatch
from engine.spec.draft_tree import ancestor_mask


@dataclass
class PackItem:
    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    write_slots: torch.Tensor  # [n] int64
    read_slots: torch.Tensor  # [S] int64 (must include write_slots of tokens that see themselves)
    mask: torch.Tensor | None  # [n, S] bool; None = every token sees all S slots


_CAUSAL: dict[int, torch.Tensor] = {}


def _causal(n: int) -> torch.Tensor:
    """[n, n] bool lower triangle (cached per n: `tril` on a fresh tensor costs tens of µs on two CPU threads)."""
    m = _CAUSAL.get(n)
    if m is None:
        m = _CAUSAL[n] = torch.ones(n, n, dtype=torch.bool).tril()
    return m


def chain_item(tokens: list[int] | torch.Tensor, ctx_slots: torch.Tensor, write_slots: torch.Tensor) -> PackItem:
    """A causal chain of new tokens after `ctx_slots` [c] of committed context."""
    toks = torch.as_tensor(tokens, dtype=torch.long)
    n, c = toks.shape[0], ctx_slots.shape[0]
    mask = None
    if n > 1:
        mask = torch.ones(n, c + n, dtype=torch.bool)
        mask[:, c:] = _causal(n)
    return PackItem(toks, torch.arange(c, c + n), write_slots, torch.cat([ctx_slots, write_slots]), mask)


def tree_item(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ctx_slots: torch.Tensor,
    write_slots: torch.Tensor,
) -> PackItem:
    """Tree nodes (node 0 = root at position c) after `ctx_slots` [c]; each node sees its ancestors."""
    n, c = tokens.shape[0], ctx_slots.shape[0]
    mask = None
    if n > 1:
        mask = torch.ones(n, c + n, dtype=torch.bool)
        mask[:, c:] = ancestor_mask(parents)
    return PackItem(tokens, c + depths, write_slots, torch.cat([ctx_slots, write_slots]), mask)


def expansion_item(
    nodes: list[int],
    tokens: list[int],
    parents: list[int],
    depths: list[int],
    ctx_slots: torch.Tensor,
    fed_slots: dict[int, int],
) -> PackItem:
    """One depth of a draft tree being grown by a drafter: `nodes` (the new frontier) over `ctx_slots` [c] of
    committed context, the last of which holds the root (position c - 1, node depth d -> position c - 1 + d).

    tokens / parents / depths: the tree so far (node 0 = root, committed, not a column here); fed_slots:
    node -> scratch slot of every node fed this round, `nodes` included (their write slots). Each node
    sees the whole context and its fed ancestors (and itself)."""
    fed = sorted(fed_slots)
    read = torch.cat([ctx_slots, torch.tensor([fed_slots[i] for i in fed], dtype=torch.long)])  # [c + f]
    c = ctx_slots.shape[0]
    column = {node: j for j, node in enumerate(fed)}
    seen = []  # [n][f]: fed column j is node i or one of its ancestors (`ancestor_mask` restricted to the fed)
    for i in nodes:
        row = [False] * len(fed)
        while i >= 0:
            if (j := column.get(i)) is not None:
                row[j] = True
            i = parents[i]
        seen.append(row)
    mask = torch.ones(len(nodes), read.shape[0], dtype=torch.bool)
    mask[:, c:] = torch.tensor(seen, dtype=torch.bool).view(len(nodes), len(fed))
    return PackItem(
        tokens=torch.tensor([tokens[i] for i in nodes]),
        positions=torch.tensor([c - 1 + depths[i] for i in nodes]),
        write_slots=torch.tensor([fed_slots[i] for i in nodes], dtype=torch.long),
        read_slots=read,
        mask=mask,
    )


def _run_start(slots: torch.Tensor) -> int | None:
    """slots [S] -> slots[0] when they are slots[0], slots[0] + 1, ..., else None."""
    S = slots.shape[0]
    if S == 0:
        return None
    first, last = slots[[0, -1]].tolist()
    if last - first != S - 1:
        return None
    return first if S == 1 or bool((slots.diff() == 1).all()) else None


def pack(items: list[PackItem], device: torch.device) -> ForwardBatch:
    """Pad and pack items into one ForwardBatch (mask None when B = 1 and every token sees all)."""
    B = len(items)
    lens = [it.tokens.shape[0] for it in items]
    N = sum(lens)
    Tq = max(lens)
    S = max(it.read_slots.shape[0] for it in items)
    if B == 1:
        it = items[0]
        return ForwardBatch(
            input_ids=it.tokens.to(device),
            positions=it.positions.to(device),
            pad_index=torch.arange(N, device=device).unsqueeze(0),
            write_slots=it.write_slots.to(device),
            read_slots=it.read_slots.to(device).unsqueeze(0),
            attn_mask=None if it.mask is None else it.mask.to(device).unsqueeze(0),
            read_start=_run_start(it.read_slots),
        )
    read_slots = torch.zeros(B, S, dtype=torch.long)
    pad_index = torch.full((B, Tq), N, dtype=torch.long)
    attn = torch.zeros(B, Tq, S, dtype=torch.bool)
    off = 0
    for b, (it, n) in enumerate(zip(items, lens)):
        s = it.read_slots.shape[0]
        read_slots[b, :s] = it.read_slots
        pad_index[b, :n] = torch.arange(off, off + n)
        if it.mask is None:
            attn[b, :n, :s] = True
        else:
            attn[b, :n, :s] = it.mask
        attn[b, n:, 0] = True  # padded queries attend somewhere; their output is dropped
        off += n
    return ForwardBatch(
        input_ids=torch.cat([it.tokens for it in items]).to(device),
        positions=torch.cat([it.positions for it in items]).to(device),
        pad_index=pad_index.to(device),
        write_slots=torch.cat([it.write_slots for it in items]).to(device),
        read_slots=read_slots.to(device),
        attn_mask=attn.to(device),
    )
