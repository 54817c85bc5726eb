"""The pieces `engine.zoo.train_heads` runs: the frozen target pass, the head and predictor objectives,
their held-out evaluation.

- `target_pass`: features f [W, T, D] and routing expert_ids [W, T, L, r] of windows [W, T+1];
- `train_eagle` (EAGLE 2401.15077 §4.3), `train_mtp` (DeepSeek-V3 2412.19437 §2.2), `train_predictor`
  (routing of position t from a head's or a dense drafter's features), all through `train_lm.train_loop`;
- `evaluate_heads` (top-1 agreement / accuracy), `predictor_report` (top-r recall vs baselines),
  `speculative_eval` (τ, verified tokens and expert footprint through `engine.Engine`);
- `smoke_target`: the random tiny MoE target of `python -m engine.zoo.train_heads smoke=true`.

Shape letters: W=windows B=batch T=window length D=hidden V=vocab L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.batching import chain_item, pack
from engine.models.checkpoint import init_weights
from engine.models.config import parse_config
from engine.models.expert_predictor import (
    ExpertPredictor,
    ExpertPredictorConfig,
    popularity_recall,
    routing_loss,
    topr_recall,
)
from engine.models.feature_heads import EagleHead, FeatureHead, MTPHead
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model
from engine.runtime.engine import Engine
from engine.spec.config import SpecConfig
from engine.zoo.configs import EagleConf, EvalConf, HeadTrainConf, MTPConf, PredictorConf
from engine.zoo.train_lm import OnStep, train_loop

SMOKE_TARGET = dict(
    model_type="qwen2_moe",
    vocab_size=256,  # bytes
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    norm_topk_prob=False,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def smoke_target(seed: int = 0) -> Model:
    """The random `SMOKE_TARGET` with weights ~ N(0, 0.1): sharp enough to have preferences to learn."""
    return init_weights(Model(parse_config(SMOKE_TARGET)), seed, std=0.1).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------- target pass
@dataclass
class TargetPass:
    """What the frozen target says about windows [W, T+1] (inputs windows[:, :T])."""

    features: torch.Tensor  # [W, T, D] float32, final hidden state after the norm
    expert_ids: torch.Tensor | None  # [W, T, L, r] uint8, routed experts per MoE layer (None: dense model)


@torch.inference_mode()
def target_pass(target: Model, windows: torch.Tensor, batch_size: int = 8) -> TargetPass:
    """Features and routing of every window's first T tokens (one cached forward per batch).

    Works for a dense model too (a drafter's hidden states; expert_ids None)."""
    cfg = target.config
    W, T = windows.shape[0], windows.shape[1] - 1
    features = torch.empty(W, T, cfg.hidden_size)
    expert_ids = torch.empty(W, T, len(cfg.moe_layers), cfg.top_r, dtype=torch.uint8) if cfg.is_moe else None
    bs = 16
    for lo in range(0, W, batch_size):
        rows = windows[lo : lo + batch_size, :T]
        B = rows.shape[0]
        kv = PagedKVCache.for_model(cfg, B * -(-T // bs), bs, target.dtype, target.device)
        items = []
        for b in range(B):
            kv.add_sequence(b)
            kv.reserve(b, T)
            slots = kv.slots(b, range(T))
            items.append(chain_item(rows[b], slots[:0], slots))
        out = target.forward_batch(pack(items, target.device), kv, record_routing=expert_ids is not None)
        features[lo : lo + B] = out.hidden.float().view(B, T, -1).cpu()
        if expert_ids is not None:
            ids = torch.stack(out.routing.expert_ids, dim=1)  # [B*T, L, r]
            expert_ids[lo : lo + B] = ids.view(B, T, *ids.shape[1:]).to(torch.uint8).cpu()
    return TargetPass(features, expert_ids)


# ---------------------------------------------------------------------------------------------- training
def _batches(num: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """`steps` index batches [B] over range(num): a seeded permutation per epoch."""
    if num < batch_size:
        raise ValueError(f"only {num} training rows for batch size {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(num, generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > num:
            order, pos = torch.randperm(num, generator=gen), 0
        yield order[pos : pos + batch_size]
        pos += batch_size


def _fit(
    module: torch.nn.Module,
    c: HeadTrainConf,
    num_rows: int,
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    seed: int,
    desc: str,
    on_step: OnStep | None,
) -> dict[str, float]:
    """`train_lm.train_loop` over seeded index batches; returns the smoothed final losses, steps and seconds."""
    return train_loop(module, c, _batches(num_rows, c.batch_size, c.steps, seed), loss_fn, desc, on_step, "rows")


def _subset(n: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A random subset [max(1, fraction * n)] of range(n): the positions whose loss needs the lm_head
    (a [n, V] projection costs as much as the head itself; the feature loss keeps every position)."""
    return torch.randperm(n, generator=gen)[: max(1, round(fraction * n))]


def train_eagle(head: EagleHead, target: Model, windows: torch.Tensor, data: TargetPass, c: EagleConf, seed: int,
                on_step: OnStep | None = None) -> dict[str, float]:  # fmt: skip
    """EAGLE objective on windows [W, T+1] with target features data.features [W, T, D]."""
    gen = torch.Generator().manual_seed(seed + 17)
    T = windows.shape[1] - 1

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        f = data.features[idx]  # [B, T, D] f_0..f_{T-1}
        inputs = f[:, :-1]
        if c.feature_noise > 0:
            inputs = inputs + (torch.rand(inputs.shape, generator=gen) * 2 - 1) * c.feature_noise
        emb = target.model.embed_tokens(windows[idx, 1:T])  # [B, T-1, D] x_1..x_{T-1}
        pred = head(inputs, emb)  # [B, T-1, D] f^_1..f^_{T-1}
        truth = f[:, 1:]
        reg = F.smooth_l1_loss(pred, truth)
        sel = _subset(truth.shape[0] * truth.shape[1], c.loss_fraction, gen)  # [n]
        with torch.no_grad():
            target_probs = torch.softmax(target.lm_head(truth.flatten(0, 1)[sel]), dim=-1)  # [n, V] law of x_{t+2}
        draft_logprobs = torch.log_softmax(target.lm_head(pred.flatten(0, 1)[sel]), dim=-1)  # [n, V]
        cls = -(target_probs * draft_logprobs).sum(-1).mean()
        return c.reg_weight * reg + c.cls_weight * cls, {"reg": reg.item(), "cls": cls.item()}

    return _fit(head, c.train, windows.shape[0], loss_fn, seed, "eagle", on_step)


def train_mtp(head: MTPHead, target: Model, windows: torch.Tensor, data: TargetPass, c: MTPConf, seed: int,
              on_step: OnStep | None = None) -> dict[str, float]:  # fmt: skip
    """MTP objective: CE of x_{t+2} from (f_t, emb(x_{t+1})), t = 0..T-2."""
    gen = torch.Generator().manual_seed(seed + 17)
    T = windows.shape[1] - 1

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        emb = target.model.embed_tokens(windows[idx, 1:T])  # [B, T-1, D]
        out = head(data.features[idx, :-1], emb).flatten(0, 1)  # [B*(T-1), D]
        sel = _subset(out.shape[0], c.loss_fraction, gen)
        logits = target.lm_head(head.readout(out[sel]))  # [n, V]
        ce = F.cross_entropy(logits, windows[idx, 2:].flatten()[sel])
        if c.target_kl_weight <= 0:
            return ce, {"ce": ce.item()}
        with torch.no_grad():  # the target's law of x_{t+2}: lm_head(f_{t+1})
            target_probs = torch.softmax(target.lm_head(data.features[idx, 1:].flatten(0, 1)[sel]), dim=-1)
        distill = -(target_probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        return ce + c.target_kl_weight * distill, {"ce": ce.item(), "distill": distill.item()}

    return _fit(head, c.train, windows.shape[0], loss_fn, seed, "mtp", on_step)


@torch.no_grad()
def head_outputs(head: FeatureHead, target: Model, windows: torch.Tensor, data: TargetPass,
                 batch_size: int = 32) -> torch.Tensor:  # fmt: skip
    """Teacher-forced head outputs [W, T-1, D]: row t-1 is the head's output at position t (inputs f_{t-1}, x_t)."""
    T = windows.shape[1] - 1
    outs = []
    for lo in range(0, windows.shape[0], batch_size):
        sl = slice(lo, lo + batch_size)
        outs.append(head(data.features[sl, :-1], target.model.embed_tokens(windows[sl, 1:T])))
    return torch.cat(outs)


def train_predictor(predictor: ExpertPredictor, features: torch.Tensor, expert_ids: torch.Tensor, c: PredictorConf,
                    seed: int, on_step: OnStep | None = None) -> dict[str, float]:  # fmt: skip
    """features [N, D] -> routing expert_ids [N, L, r]: CE against the uniform law on the routed set."""

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        loss = routing_loss(predictor(features[idx]), expert_ids[idx])
        return loss, {"ce": loss.item()}

    return _fit(predictor, c.train, features.shape[0], loss_fn, seed, "predictor", on_step)


def new_expert_predictor(target: Model, in_features: int, input_kind: str, c: PredictorConf) -> ExpertPredictor:
    tcfg = target.config
    return ExpertPredictor(
        ExpertPredictorConfig(
            in_features=in_features,
            hidden_size=c.hidden_size,
            num_experts=tcfg.num_experts,
            top_r=tcfg.top_r,
            moe_layers=tuple(tcfg.moe_layers),
            input=input_kind,
        )
    )


@torch.no_grad()
def predictor_report(predictor: ExpertPredictor, features: torch.Tensor, expert_ids: torch.Tensor,
                     train_ids: torch.Tensor) -> dict:  # fmt: skip
    """Held-out top-r recall per MoE layer of features [N, D] vs routing expert_ids [N, L, r], next to the
    random (r / E) and popularity (most frequent experts of train_ids) baselines."""
    cfg = predictor.config
    recall = topr_recall(predictor(features), expert_ids)
    popular = popularity_recall(train_ids, expert_ids, cfg.num_experts)
    return {
        "input": cfg.input,
        "topr_recall_per_layer": [round(float(x), 4) for x in recall],
        "topr_recall_mean": float(recall.mean()),
        "random_baseline": cfg.top_r / cfg.num_experts,
        "popularity_baseline_per_layer": [round(float(x), 4) for x in popular],
        "moe_layers": list(cfg.moe_layers),
        "tokens": int(expert_ids.shape[0]),
        "params": num_params(predictor),
    }


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_heads(eagle: EagleHead, mtp: MTPHead, target: Model, windows: torch.Tensor,
                   data: TargetPass) -> dict[str, float]:  # fmt: skip
    """Held-out top-1 metrics over every position t = 0..T-2 of windows [W, T+1].

    eagle_top1_agreement: argmax lm_head(f^_{t+1}) == argmax lm_head(f_{t+1}) (teacher-forced inputs).
    mtp_top1_accuracy_t2: argmax of the MTP law == x_{t+2}; mtp_top1_agreement_t2: == the target's argmax
    for x_{t+2} (given the true x_{t+1}), what greedy verification checks. target_top1_accuracy: reference."""
    T = windows.shape[1] - 1
    sums = dict.fromkeys(("eagle", "eagle_text", "mtp_text", "mtp_target", "target_text"), 0)
    n = 0
    for lo in range(0, windows.shape[0], 32):
        sl = slice(lo, lo + 32)
        f = data.features[sl]  # [B, T, D]
        emb = target.model.embed_tokens(windows[sl, 1:T])
        target_next = target.lm_head(f).argmax(-1)  # [B, T] argmax for x_{t+1}
        eagle_next = target.lm_head(eagle(f[:, :-1], emb)).argmax(-1)  # [B, T-1] for x_{t+2}
        mtp_next = target.lm_head(mtp.readout(mtp(f[:, :-1], emb))).argmax(-1)  # [B, T-1] for x_{t+2}
        text2 = windows[sl, 2:]  # x_2..x_T
        sums["eagle"] += int((eagle_next == target_next[:, 1:]).sum())
        sums["eagle_text"] += int((eagle_next == text2).sum())
        sums["mtp_text"] += int((mtp_next == text2).sum())
        sums["mtp_target"] += int((mtp_next == target_next[:, 1:]).sum())
        sums["target_text"] += int((target_next[:, 1:] == text2).sum())
        n += text2.numel()
    n = max(n, 1)
    return {
        "eagle_top1_agreement": sums["eagle"] / n,
        "eagle_top1_accuracy": sums["eagle_text"] / n,
        "mtp_top1_accuracy_t2": sums["mtp_text"] / n,
        "mtp_top1_agreement_t2": sums["mtp_target"] / n,
        "target_top1_accuracy": sums["target_text"] / n,
        "positions": n,
    }


def speculative_eval(target: Model, drafters: dict[str, object], prompts: list[list[int]], c: EvalConf) -> dict:
    """Per drafter and spec (see `EvalConf`): τ (committed per round), verified tokens per round, distinct
    experts per MoE layer per verification (footprint), and whether the output equals target-only greedy."""
    out: dict[str, dict] = {}
    K, W, F_, m = c.depth, c.width, c.frontier, c.max_verify
    specs = {
        f"chain_K{K}": SpecConfig(depth=K, width=1),
        f"tree_K{K}W{W}F{F_}": SpecConfig(depth=K, width=W, frontier=F_),
        f"tree_K{K}W{W}F{F_}_m{m}": SpecConfig(depth=K, width=W, frontier=F_, max_verify=m),
        f"tree_K{K}W{W}F{F_}_m{m}_lam{c.lam:g}": SpecConfig(depth=K, width=W, frontier=F_, max_verify=m, lam=c.lam),
    }
    base = None
    for name, drafter in drafters.items():
        eng = Engine(target, drafter=drafter, timing=False)
        if base is None:
            base = [r.token_ids for r in Engine(target, timing=False).generate(prompts, c.new_tokens)]
        res: dict[str, dict] = {}
        for sname, spec in specs.items():
            if spec.lam > 0 and getattr(drafter, "predictor", None) is None:
                continue
            results = eng.generate(prompts, c.new_tokens, spec=spec)
            rounds = [r for x in results for r in x.rounds]
            res[sname] = {
                "tau": sum(r.committed for r in rounds) / max(len(rounds), 1),
                "verified_per_round": sum(r.verified_tokens for r in rounds) / max(len(rounds), 1),
                "distinct_experts_per_layer": sum(sum(r.distinct_experts) / len(r.distinct_experts) for r in rounds)
                / max(len(rounds), 1),
                "exact": [x.token_ids for x in results] == base,
            }
        out[name] = res
    return out


def num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
