"""Expert-parallel greedy generation with a parity check against the single-process engine (Hydra).

    torchrun --standalone --nproc_per_node 2 -m engine.ep_run                      # tiny random qwen2_moe
    torchrun --standalone --nproc_per_node 4 -m engine.ep_run model=PATH placement=load_balanced
    torchrun --standalone --nproc_per_node 2 -m engine.ep_run placement=replicated num_replicated=2

Each rank generates greedily for its own prompts (data-parallel attention, experts sharded by
`engine.ep`; rank w asks for `new_tokens - 3w` tokens, so ranks finish at different steps and idle in
lockstep). load_balanced / replicated placements are calibrated per MoE layer on the routing of all
ranks' prompts. Rank 0 prints per-rank loads and checks every rank's tokens against the
single-process engine on the same prompts; the exit status is 1 on a mismatch. Without `model=` every
rank saves the same seeded tiny random qwen2_moe (8 experts) to its own temp dir and loads it back (no
downloads). gloo on CPU, NCCL on CUDA (one GPU per rank).

Shape letters: L=MoE layers E=experts.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from engine.models.checkpoint import build_model, init_weights, load_model, save_model
from engine.models.transformer import Model
from engine.parallel.ep import EPGroup, init_distributed, shard_model, shutdown_distributed
from engine.parallel.placement import place_experts
from engine.runtime.engine import Engine

TINY_QWEN2_MOE = dict(
    model_type="qwen2_moe",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,
)


@dataclass
class EPRunConfig:
    model: str | None = None  # HF checkpoint folder; None = a tiny random qwen2_moe
    placement: str = "contiguous"  # contiguous | round_robin | load_balanced | replicated
    num_replicated: int = 1  # hot experts copied to every rank (placement=replicated)
    ranks_per_node: int | None = None  # None = torchrun's LOCAL_WORLD_SIZE
    prompts_per_rank: int = 2
    new_tokens: int = 16
    seed: int = 0
    check: bool = True  # rank 0 compares with the single-process engine
    threads: int = 1


cs = ConfigStore.instance()
cs.store(name="ep_run_schema", node=EPRunConfig)


def _load_models(cfg: EPRunConfig, with_reference: bool) -> tuple[Model, Model | None]:
    """(target, single-process reference or None), loaded before the process group exists (see
    `engine.ep.shutdown_distributed`). Without `model=`: a tiny random qwen2_moe saved to a temp dir and
    loaded back, the same on every rank (seeded)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="ep_run_") as tmp:
        path = cfg.model
        if not path:
            model = init_weights(build_model(TINY_QWEN2_MOE, seed=cfg.seed), seed=cfg.seed, std=0.2)
            path = str(save_model(model, f"{tmp}/tiny_moe"))
        target = load_model(path, device=device)
        return target, load_model(path, device=device) if with_reference else None


def _prompts(cfg: EPRunConfig, rank: int, vocab: int) -> tuple[list[list[int]], int]:
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    lengths = torch.randint(1, 13, (cfg.prompts_per_rank,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return prompts, max(1, cfg.new_tokens - 3 * rank)


def _expert_counts(model: Model, prompts: list[list[int]]) -> torch.Tensor:
    """[L, E] routed assignments of every rank's prompts (one plain forward each, summed over ranks)."""
    blocks = model.moe_blocks
    counts = torch.zeros(len(blocks), blocks[0].num_experts, device=model.device)
    for i, b in enumerate(blocks):

        def count(h, w_gate_up, w_down, expert_ids, topk_weights, i=i, b=b):
            counts[i] += torch.bincount(expert_ids.reshape(-1), minlength=b.num_experts)
            return b.local_experts(h, w_gate_up, w_down, expert_ids, topk_weights)

        b.expert_fn = count
    try:
        for p in prompts:
            model.logits(torch.tensor([p], device=model.device))
    finally:
        for b in blocks:
            b.expert_fn = None
    dist.all_reduce(counts)
    return counts.cpu()


def run(cfg: EPRunConfig) -> bool:
    """Generate on every rank; rank 0 prints loads and the parity result (its return value; True elsewhere)."""
    target, ref = _load_models(cfg, with_reference=cfg.check and int(os.environ.get("RANK", 0)) == 0)
    rank, world = init_distributed()
    prompts, max_new = _prompts(cfg, rank, target.vocab_size)
    E = target.config.num_experts
    rpn = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cfg.placement in ("load_balanced", "replicated"):
        counts = _expert_counts(target, prompts)  # [L, E]
    else:
        counts = torch.ones(len(target.moe_blocks), E)
    placements = [
        place_experts(
            E,
            world,
            cfg.placement,
            ranks_per_node=rpn,
            expert_counts=c,
            num_replicated=cfg.num_replicated if cfg.placement == "replicated" else 0,
        )
        for c in counts
    ]
    ep = shard_model(target, EPGroup.from_env(placements, ranks_per_node=rpn))
    t0 = time.perf_counter()
    results = Engine(target, ep=ep).generate(prompts, max_new)
    seconds = time.perf_counter() - t0
    mine = dict(
        prompts=prompts,
        max_new=max_new,
        tokens=[r.token_ids for r in results],
        loads=ep.loads(),
        rows=sum(fn.rows_received for fn in ep.fns),
        seconds=seconds,
    )
    everyone: list[dict | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return True
    _print_loads(cfg, everyone, placements)
    return _check(ref, everyone) if ref is not None else True


def _print_loads(cfg: EPRunConfig, everyone: list, placements) -> None:
    world = len(everyone)
    L = len(placements)
    print(f"EP over {world} ranks, placement={cfg.placement}, {L} MoE layers")
    for layer, p in enumerate(placements):
        print(f"  MoE layer {layer}: experts per rank {[list(x) for x in p.rank_experts]}")
    print("rank  requests  new_tokens  rows_received  assignments served per layer   seconds")
    for w, d in enumerate(everyone):
        n_new = sum(len(t) for t in d["tokens"])
        loads = str(d["loads"])
        print(f"{w:>4}  {len(d['prompts']):>8}  {n_new:>10}  {d['rows']:>13}  {loads:<30} {d['seconds']:.3f}")
    for layer in range(L):
        loads = [d["loads"][layer] for d in everyone]
        mean = sum(loads) / world
        imbalance = max(loads) / mean if mean else 1.0
        print(f"MoE layer {layer}: rank imbalance (max/mean assignments) {imbalance:.2f}")


def _check(ref: Model, everyone: list) -> bool:
    """Rank 0: the single-process engine on every rank's prompts must give the same tokens."""
    engine = Engine(ref)
    ok = True
    for w, d in enumerate(everyone):
        want = [r.token_ids for r in engine.generate(d["prompts"], d["max_new"])]
        if want != d["tokens"]:
            ok = False
            print(f"rank {w}: MISMATCH\n  ep:     {d['tokens']}\n  single: {want}")
    print("parity with the single-process engine:", "OK" if ok else "MISMATCH")
    return ok


@hydra.main(config_path=None, config_name="ep_run_schema", version_base=None)
def main(cfg: EPRunConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    torch.set_num_threads(cfg.threads)
    try:
        ok = run(cfg)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if not shutdown_distributed(ok):
        raise SystemExit(1)


if __name__ == "__main__":
    from engine.cli import quiet_hydra_argv

    quiet_hydra_argv()
    main()
