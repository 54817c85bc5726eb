"""Expert parallelism (EP) over torch.distributed: experts sharded over ranks, attention data-parallel.

    init_distributed()                                   # torchrun env: gloo on CPU, NCCL on CUDA
    group = EPGroup.from_env(place_experts(E, W, "contiguous", ranks_per_node=8))
    ep = shard_model(target, group)                      # an ExpertParallelFn on every MoE block
    results = Engine(target, ep=ep).generate(my_prompts, 32)     # each rank runs its own requests

    torchrun --standalone --nproc_per_node 2 -m engine.ep_run     # demo + parity check (engine/ep_run.py)

One MoE call, on every rank, whatever its token count (0 included):

    route     expert_ids [T, r] -> serving rank [T, r]: the expert's rank; for a replicated expert a
              replica on this rank, else the least-loaded one on this node, else anywhere
              (`placement.assign_ranks`, deterministic, the rule the virtual layout stats use)
    pack      one row per (token, destination): hidden + routing weights, and the token's expert ids
              with the slots served elsewhere set to -1; rows sorted by destination, then token
    a2a 1     rows per destination                           int64 [W]
    a2a 2, 3  rows [n, D + r] (hidden dtype), expert ids [n, r] int64
    compute   kernels.fused_moe on the m received rows, ids remapped to local storage: the routing-
              weighted sum over this rank's slots of each token             [m, D]
    a2a 4     partial sums back to their source ranks (split sizes of a2a 2 reversed)
    combine   out[t] = sum of the partial sums returned for t               [T, D]

A token goes at most once to each rank however many of its r experts live there. Every call issues
the same four collectives in the same order, so a rank with zero tokens (`ExpertParallel.idle_step`)
keeps the others going. All exchanges use `dist.all_to_all_single` with uneven split sizes, which
gloo (CPU) and NCCL (CUDA) both implement, zero-size splits included (checked on torch 2.13 gloo);
the list form `dist.all_to_all` is not used.

Shape letters: T=local tokens r=top-r D=hidden F=expert dim E=experts El=experts stored on this rank
W=ranks n=rows sent m=rows received.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.models.moe import MoEBlock
from engine.models.transformer import Model
from engine.parallel.placement import ExpertPlacement, assign_ranks


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the default process group from the torchrun environment (no-op if already joined).

    backend None: NCCL when CUDA is available (device = LOCAL_RANK), else gloo. Returns (rank, world).
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed(ok: bool = True) -> bool:
    """Last collective of an entry point: returns the AND of every rank's `ok`, then destroys the group.

    Load models *before* `init_process_group`: on torch 2.13 a meta-device op run while a process
    group exists (load_model builds on meta) keeps that group alive past `destroy_process_group`, and
    its gloo threads, still releasing the last collective's tensors, can then abort the interpreter's
    shutdown ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return bool(flag.item())


def _same_nodes(world_size: int, ranks_per_node_a: int, ranks_per_node_b: int) -> bool:
    return all(w // ranks_per_node_a == w // ranks_per_node_b for w in range(world_size))


@dataclass
class EPGroup:
    """Communication context of one EP rank: who it is, who holds which expert, where ranks live.

    placement: one `ExpertPlacement` for every MoE layer, or a sequence with one per MoE layer.
    group: the process group of the EP ranks (None = the default group).
    ranks_per_node: topology; ranks w // ranks_per_node share a node (must agree with the placement's).
    debug: record a `DispatchRecord` per MoE call (provenance of every received row).
    """

    rank: int
    world_size: int
    placement: ExpertPlacement | Sequence[ExpertPlacement]
    ranks_per_node: int
    group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    debug: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside the world [0, {self.world_size})")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for p in self.placements:
            if p.world_size != self.world_size:
                raise ValueError(f"placement is for {p.world_size} ranks, the EP group has {self.world_size}")
            if not _same_nodes(self.world_size, p.ranks_per_node, self.ranks_per_node):
                raise ValueError(
                    f"placement assumes {p.ranks_per_node} ranks per node, the EP group has "
                    f"{self.ranks_per_node}: node membership differs"
                )

    @classmethod
    def from_env(
        cls,
        placement: ExpertPlacement | Sequence[ExpertPlacement],
        group: dist.ProcessGroup | None = None,
        ranks_per_node: int | None = None,
        debug: bool = False,
    ) -> EPGroup:
        """The group of an initialised process group; ranks_per_node defaults to torchrun's
        LOCAL_WORLD_SIZE (else the placement's); NCCL groups communicate on the current CUDA device."""
        world = dist.get_world_size(group)
        if ranks_per_node is None:
            first = placement if isinstance(placement, ExpertPlacement) else placement[0]
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(first.ranks_per_node, world)))
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return cls(dist.get_rank(group), world, placement, ranks_per_node, group, device, debug)

    @property
    def placements(self) -> tuple[ExpertPlacement, ...]:
        return (self.placement,) if isinstance(self.placement, ExpertPlacement) else tuple(self.placement)

    def layer_placements(self, num_moe_layers: int) -> tuple[ExpertPlacement, ...]:
        """One placement per MoE layer (a single placement is shared by all)."""
        ps = self.placements
        if isinstance(self.placement, ExpertPlacement):
            return ps * num_moe_layers
        if len(ps) != num_moe_layers:
            raise ValueError(f"{len(ps)} placements for {num_moe_layers} MoE layers")
        return ps


@dataclass(frozen=True)
class DispatchRecord:
    """What one rank received in one MoE call (debug mode). m = rows received."""

    layer: int
    source_ranks: torch.Tensor  # [m] rank each received row came from
    expert_ids: torch.Tensor  # [m, r] global expert ids, -1 = slot served on another rank
    hidden: torch.Tensor  # [m, D] received hidden rows
    send_counts: tuple[int, ...]  # [W] rows this rank sent to each rank


@dataclass(eq=False)
class ExpertParallelFn:
    """`MoEBlock.expert_fn` for one MoE layer: dispatch -> local experts -> combine (module docstring).

    Called as fn(hidden [T, D], w_gate_up [El, 2F, D], w_down [El, D, F], expert_ids [T, r],
    topk_weights [T, r]) -> [T, D]; the weights are this rank's stored experts and
    local_index [E] maps a global expert id to its row in them (-1: not stored here).
    """

    group: EPGroup
    placement: ExpertPlacement
    layer: int
    local_index: torch.Tensor  # [E] int64
    block: MoEBlock = field(repr=False)  # read for its backend (Engine sets it after sharding)
    records: list[DispatchRecord] | None = field(default=None, repr=False)
    rows_sent: int = 0
    rows_received: int = 0
    _served: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        primary = [ranks[0] for ranks in self.placement.expert_ranks]
        self._primary = torch.tensor(primary, dtype=torch.long, device=self.group.device)  # [E]
        self._replicated = bool(self.placement.replicated_experts)
        self.local_index = self.local_index.to(self.group.device)

    @property
    def served_assignments(self) -> int:
        """(token, expert) assignments this rank computed for this layer since the last reset."""
        return 0 if self._served is None else int(self._served)

    def reset_stats(self) -> None:
        self.rows_sent = self.rows_received = 0
        self._served = None

    def serving_ranks(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, r] -> rank serving each assignment [T, r] (-1 where the id is -1)."""
        valid = expert_ids >= 0
        ids = expert_ids.clamp(min=0).long()
        if self._replicated:
            home = torch.full((ids.shape[0],), self.group.rank, dtype=torch.long)
            serving = assign_ranks(ids.cpu(), self.placement, home).to(ids.device)
        else:
            serving = self._primary[ids]
        return torch.where(valid, serving, -1)

    def _exchange(self, send: torch.Tensor, recv_split: list[int], send_split: list[int]) -> torch.Tensor:
        """Uneven all_to_all: rows send[sum(send_split[:w]) : ...] go to rank w."""
        out = send.new_empty((sum(recv_split), *send.shape[1:]))
        dist.all_to_all_single(out, send.contiguous(), recv_split, send_split, group=self.group.group)
        return out

    def __call__(
        self,
        hidden: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        T, D = hidden.shape
        r = expert_ids.shape[1]
        W = self.group.world_size
        dev = hidden.device
        # pack: one row per (destination, token) pair, destination-major
        serving = self.serving_ranks(expert_ids)  # [T, r]
        token = torch.arange(T, device=dev)[:, None].expand(T, r)
        keys = torch.unique((serving * max(T, 1) + token)[serving >= 0])  # [n] sorted
        dest, tok = keys // max(T, 1), keys % max(T, 1)  # [n], [n]
        here = serving[tok] == dest[:, None]  # [n, r] slots this destination serves
        send_ids = torch.where(here, expert_ids[tok].long(), -1)  # [n, r]
        send_w = torch.where(here, topk_weights[tok], 0).to(hidden.dtype)  # [n, r]
        send_rows = torch.cat([hidden[tok], send_w], dim=1)  # [n, D + r]
        send_counts = torch.bincount(dest, minlength=W)  # [W]
        # a2a 1: counts; a2a 2, 3: rows and ids
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        recv_rows = self._exchange(send_rows, recv_split, send_split)  # [m, D + r]
        recv_ids = self._exchange(send_ids, recv_split, send_split)  # [m, r]
        m = recv_rows.shape[0]
        # compute: only experts stored here were sent here
        if m:
            valid = recv_ids >= 0
            local_ids = torch.where(valid, self.local_index[recv_ids.clamp(min=0)], -1)  # [m, r]
            if bool((local_ids[valid] < 0).any()):
                raise RuntimeError(f"layer {self.layer}: rank {self.group.rank} received an expert it does not hold")
            partial = self.block.local_experts(  # the block's own expert math (gpt_oss: biases, clamped SwiGLU)
                recv_rows[:, :D].contiguous(), w_gate_up, w_down, local_ids, recv_rows[:, D:].contiguous()
            )  # [m, D]
            served = valid.sum()
            self._served = served if self._served is None else self._served + served
        else:
            partial = hidden.new_empty(0, D)
        if self.records is not None:
            src = torch.repeat_interleave(torch.arange(W, device=dev), recv_counts)  # [m]
            self.records.append(
                DispatchRecord(self.layer, src.cpu(), recv_ids.cpu(), recv_rows[:, :D].cpu(), tuple(send_split))
            )
        self.rows_sent += len(tok)
        self.rows_received += m
        # a2a 4: partial sums back; combine in fp32 (fp64 stays fp64)
        back = self._exchange(partial, send_split, recv_split)  # [n, D]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.zeros(T, D, dtype=acc, device=dev).index_add_(0, tok, back.to(acc))
        return out.to(hidden.dtype)


@dataclass
class ExpertParallel:
    """The engine's `ep` object (`Engine(target, ep=...)`): lockstep helpers over a sharded model.

    fns: one `ExpertParallelFn` per MoE layer, in layer order. records: the shared debug trace
    (`DispatchRecord` per call, in call order) or None when the group is not in debug mode.
    """

    group: EPGroup
    fns: list[ExpertParallelFn]
    records: list[DispatchRecord] | None = None

    def any_active(self, local_has_work: bool) -> bool:
        """Global OR of every rank's flag (all_reduce MAX)."""
        flag = torch.tensor([int(local_has_work)], dtype=torch.int32, device=self.group.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group.group)
        return bool(flag.item())

    @torch.no_grad()
    def idle_step(self) -> None:
        """The MoE collectives of one forward with zero local tokens: every layer's fn, in layer order."""
        for fn in self.fns:
            b = fn.block
            w = b.experts.gate_up_proj
            hidden = w.new_empty(0, w.shape[-1])  # [0, D]
            ids = torch.empty(0, b.top_r, dtype=torch.long, device=w.device)  # [0, r]
            fn(hidden, w, b.experts.down_proj, ids, w.new_empty(0, b.top_r))

    def loads(self) -> list[int]:
        """Assignments computed on this rank per MoE layer since the last `reset_stats`."""
        return [fn.served_assignments for fn in self.fns]

    def reset_stats(self) -> None:
        for fn in self.fns:
            fn.reset_stats()
        if self.records is not None:
            self.records.clear()


EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # [E, ...] each, sharded


def _moe_layers(model: Model) -> list[tuple[int, MoEBlock]]:
    return [(layer.layer, layer.mlp) for layer in model.model.layers if isinstance(layer.mlp, MoEBlock)]


def shard_model(model: Model, group: EPGroup, drop_remote: bool = True) -> ExpertParallel:
    """Install an `ExpertParallelFn` on every MoE block of `model` and return the engine's `ep` object.

    drop_remote: keep only this rank's experts in `experts.gate_up_proj [El, 2F, D]` and
    `experts.down_proj [El, D, F]` (rows in ascending expert id; `fn.local_index` maps ids to rows).
    The full weights are loaded first, so peak memory is not reduced, only the steady state.
    """
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("model has no MoE layer to shard")
    placements = group.layer_placements(len(layers))
    records: list[DispatchRecord] | None = [] if group.debug else None
    fns = []
    for (layer, block), placement in zip(layers, placements):
        if block.expert_fn is not None:
            raise ValueError(f"layer {layer} already has an expert_fn (sharded twice?)")
        E = block.num_experts
        if placement.num_experts != E:
            raise ValueError(f"placement has {placement.num_experts} experts, layer {layer} has {E}")
        held = torch.tensor(placement.rank_experts[group.rank], dtype=torch.long)  # [El]
        local_index = torch.full((E,), -1, dtype=torch.long)
        if drop_remote:
            local_index[held] = torch.arange(len(held))
            ex = block.experts
            dev = ex.gate_up_proj.device
            with torch.no_grad():  # the weights and any per-expert bias (gpt_oss), in the same row order
                for name in EXPERT_TENSORS:
                    if isinstance(getattr(ex, name, None), torch.Tensor):
                        setattr(ex, name, nn.Parameter(getattr(ex, name)[held.to(dev)].clone(), requires_grad=False))
        else:
            local_index[held] = held
        fn = ExpertParallelFn(group, placement, layer, local_index, block, records)
        block.expert_fn = fn
        fns.append(fn)
    return ExpertParallel(group, fns, records)
