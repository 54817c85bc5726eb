"""Training and evaluating the zoo's language models: the target, the distilled drafter, held-out numbers.

The pieces `python -m engine.zoo` runs (see `engine/zoo.py` for the whole pipeline and its config):

    python -m engine.zoo +experiment=zoo_smoke            # < 1 min: exercises every function here

- `train_target`: next-token cross-entropy + router_aux_loss_coef * the load-balancing aux loss;
- `distill_drafter`: kl_weight * KL(target || drafter) + ce_weight * cross-entropy, target logits on the fly;
- both through `train_loop` (AdamW from `make_optimizer`, linear warmup + cosine, grad clipping) over
  `batches` (a seeded permutation of token windows per epoch), bf16 autocast per `use_bf16_autocast`;
- `evaluate`: held-out nats/token, perplexity and drafter top-1 agreement per corpus (`heldout_table`
  renders it as markdown). The target's T(n)/T(1) is `engine.cost.verify_curve.uncached_forward_curve`.

`train_loop` is shared with `engine/zoo/head_objectives.py`.

Shape letters: B=batch T=sequence length V=vocab W=windows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.models.transformer import Model

if TYPE_CHECKING:
    from engine.zoo.configs import DrafterConf, TargetConf, TrainConf


# (desc, step 1..steps, steps, metrics: smoothed losses and "<unit>/s"), called after every optimiser step
OnStep = Callable[[str, int, int, dict[str, float]], None]


# ---------------------------------------------------------------------------------------------- training
def use_bf16_autocast(mode: str) -> bool:
    """Resolve `autocast`: "auto" = bf16 iff the CPU advertises native bf16 dot products (measured
    ~5-10% faster per training step with 2 threads on an AVX512-BF16 EPYC; much slower without)."""
    if mode in ("bf16", "off"):
        return mode == "bf16"
    if mode != "auto":
        raise ValueError(f"autocast must be 'auto', 'bf16' or 'off', got {mode!r}")
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def batches(windows: torch.Tensor, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """`steps` batches [B, T+1] of rows of `windows` [W, T+1]: seeded permutation per epoch."""
    if windows.shape[0] < batch_size:
        raise ValueError(f"only {windows.shape[0]} training windows for batch size {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(windows.shape[0], generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > order.numel():
            order, pos = torch.randperm(windows.shape[0], generator=gen), 0
        yield windows[order[pos : pos + batch_size]]
        pos += batch_size


def make_optimizer(model: Model, c: TrainConf) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay on matrices only) + linear warmup and cosine decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": c.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2))

    def factor(step: int) -> float:
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_loop(
    model: torch.nn.Module,
    c: TrainConf,
    data: Iterator[torch.Tensor],
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    desc: str,
    on_step: OnStep | None = None,
    unit: str = "tok",
) -> dict[str, float]:
    """The optimiser loop of every zoo model and head (AdamW, warmup + cosine, grad clipping) over `data`
    batches (token windows, or row indices for the heads: `unit` names what a batch element is); returns the
    final smoothed losses, step count and seconds. `on_step(desc, step, steps, metrics)` after every step
    (the entry points draw progress bars with it: `engine.cli.step_bars`)."""
    opt, sched = make_optimizer(model, c)
    model.train()
    smooth: dict[str, float] = {}
    start = time.perf_counter()
    for step, batch in enumerate(data):
        loss, parts = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        sched.step()
        for k, v in parts.items():
            smooth[k] = v if step == 0 else 0.95 * smooth[k] + 0.05 * v
        if on_step is not None:
            rate = (step + 1) * batch.numel() / (time.perf_counter() - start)
            on_step(desc, step + 1, c.steps, {**smooth, f"{unit}/s": rate})
    model.eval()
    return {
        **{f"final_{k}": v for k, v in smooth.items()},
        "steps": c.steps,
        "seconds": time.perf_counter() - start,
    }


def train_target(
    model: Model, windows: torch.Tensor, c: TargetConf, seed: int, bf16: bool, on_step: OnStep | None = None
) -> dict[str, float]:
    """Next-token cross-entropy + router_aux_loss_coef * load-balancing loss on windows [W, T+1]."""

    def loss_fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            target_logits, aux = model(batch[:, :-1], return_aux=True)  # [B, T, V], []
        ce = F.cross_entropy(target_logits.float().flatten(0, 1), batch[:, 1:].flatten())
        return ce + c.router_aux_loss_coef * aux.float(), {"ce": ce.item(), "aux": aux.item()}

    return train_loop(model, c.train, batches(windows, c.train.batch_size, c.train.steps, seed), loss_fn,
                       "target", on_step)  # fmt: skip


def distill_drafter(
    drafter: Model,
    target: Model,
    windows: torch.Tensor,
    c: DrafterConf,
    seed: int,
    bf16: bool,
    on_step: OnStep | None = None,
) -> dict[str, float]:
    """kl_weight * KL(target || drafter) + ce_weight * CE, target logits computed on the fly (no grad)."""
    target.eval()

    def loss_fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            target_logits = target(inputs)  # [B, T, V]
        target_logprobs = torch.log_softmax(target_logits.float(), dim=-1).flatten(0, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            draft_logits = drafter(inputs)  # [B, T, V]
        draft_logprobs = torch.log_softmax(draft_logits.float(), dim=-1).flatten(0, 1)
        kl = F.kl_div(draft_logprobs, target_logprobs, log_target=True, reduction="batchmean")
        ce = F.nll_loss(draft_logprobs, labels.flatten())
        return c.kl_weight * kl + c.ce_weight * ce, {"kl": kl.item(), "ce": ce.item()}

    return train_loop(drafter, c.train, batches(windows, c.train.batch_size, c.train.steps, seed), loss_fn,
                       "drafter", on_step)  # fmt: skip


# ---------------------------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def evaluate(
    target: Model, drafter: Model | None, heldout: dict[str, torch.Tensor], batch_size: int = 16
) -> dict[str, dict[str, float]]:
    """Held-out nats/token, perplexity and drafter top-1 agreement per corpus (and "all"); drafter None: the
    target's fields only.

    heldout: corpus -> windows [W, T+1]; every position after the first of a window is predicted.
    """
    report: dict[str, dict[str, float]] = {}
    totals = {"tokens": 0, "target_nats": 0.0, "drafter_nats": 0.0, "agree": 0}
    for name, windows in heldout.items():
        sums = {"tokens": 0, "target_nats": 0.0, "drafter_nats": 0.0, "agree": 0}
        for batch in windows.split(batch_size):
            inputs, labels = batch[:, :-1], batch[:, 1:].flatten()
            target_logits = target(inputs).float().flatten(0, 1)  # [B*T, V]
            sums["tokens"] += labels.numel()
            sums["target_nats"] += F.cross_entropy(target_logits, labels, reduction="sum").item()
            if drafter is not None:
                draft_logits = drafter(inputs).float().flatten(0, 1)  # [B*T, V]
                sums["drafter_nats"] += F.cross_entropy(draft_logits, labels, reduction="sum").item()
                sums["agree"] += int((target_logits.argmax(-1) == draft_logits.argmax(-1)).sum())
        for k in totals:
            totals[k] += sums[k]
        report[name] = _metrics(sums, drafter is not None)
    if report:
        report["all"] = _metrics(totals, drafter is not None)
    return report


def _metrics(s: dict, with_drafter: bool = True) -> dict[str, float]:
    n = max(1, s["tokens"])
    t, d = s["target_nats"] / n, s["drafter_nats"] / n
    out = {"tokens": s["tokens"], "target_nats_per_token": t, "target_ppl": math.exp(t)}
    if with_drafter:
        out |= {"drafter_nats_per_token": d, "drafter_ppl": math.exp(d), "top1_agreement": s["agree"] / n}
    return out


def heldout_table(report: dict[str, dict[str, float]]) -> str:
    """Markdown table of `evaluate`'s report."""
    rows = [
        "| corpus | tokens | target nats/tok | target ppl | drafter nats/tok | drafter ppl | top-1 agree |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for name, m in report.items():
        rows.append(
            f"| {name} | {m['tokens']} | {m['target_nats_per_token']:.3f} | {m['target_ppl']:.1f} | "
            f"{m['drafter_nats_per_token']:.3f} | {m['drafter_ppl']:.1f} | {m['top1_agreement']:.3f} |"
        )
    return "\n".join(rows)
