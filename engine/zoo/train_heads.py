"""Train the feature-head drafters and the expert predictor on top of a frozen MoE target.

    python -m engine.train_heads                        # zoo/tiny-moe -> zoo/{eagle-head,mtp-head,expert-predictor}
    python -m engine.train_heads smoke=true             # < 40 s: random tiny target, bytes as tokens, temp dir
    python -m engine.train_heads target=/path/to/moe out_dir=/tmp/heads seed=1 eagle.train.steps=200

Stages (`train_all_heads`, the function engine.zoo calls):
1. windows [W, T+1] from the token streams (engine.zoo's corpus split, tokenised with the target's
   tokenizer.json: held-out = the zoo's held-out documents);
2. one frozen target pass (`Model.forward_batch(record_routing=True)`): features f [W, T, D] (final hidden
   states after the norm) and routing expert_ids [W, T, L, r];
3. EAGLE head (2401.15077 §4.3): reg_weight * smooth-L1(f^_{t+1}, f_{t+1}) + cls_weight * CE(target law
   of x_{t+2}, lm_head(f^_{t+1})), inputs (f_t + U(-a, a) noise, emb(x_{t+1}));
4. MTP module (DeepSeek-V3 2412.19437 §2.2): CE(x_{t+2}) from (f_t, emb(x_{t+1})), plus target_kl_weight *
   CE against the target's law of x_{t+2} (distillation; 0 = the paper's loss);
5. expert predictor on the EAGLE head's teacher-forced outputs f^_t -> routing of position t;
6. bf16 folders (config.json, model.safetensors, metrics.json), re-loaded for every evaluation: held-out
   EAGLE top-1 agreement with the target, MTP top-1 accuracy for t+2, predictor top-r recall per layer
   against r/E and a popularity baseline, τ and expert footprint through `engine.Engine`.
Same seed, config, machine and thread count: same weights. One thread by default: with other jobs on the
2 cores, two intra-op threads ran 3-8x slower than one.

Shape letters: W=windows B=batch T=window length D=hidden V=vocab L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf
from tqdm import tqdm

from engine.drafting.feature_drafter import EagleDrafter, FeatureHead, MTPDrafter, MTPHead
from engine.models.batching import chain_item, pack
from engine.models.checkpoint import init_weights, load_model
from engine.models.config import parse_config
from engine.models.expert_predictor import (
    ExpertPredictor,
    ExpertPredictorConfig,
    load_expert_predictor,
    popularity_recall,
    routing_loss,
    save_expert_predictor,
    topr_recall,
)
from engine.models.feature_heads import EagleHead, HeadConfig, load_eagle_head, load_mtp_head, save_head, target_digest
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model
from engine.paths import repo_relative, zoo_path
from engine.runtime.engine import Engine
from engine.spec.config import SpecConfig
from engine.zoo import corpus as corpus_lib
from engine.zoo.configs import (
    HEAD_NAMES,
    DataConf,
    EagleConf,
    EvalConf,
    HeadTrainConf,
    MTPConf,
    PredictorConf,
    TrainHeadsConf,
    smoke_conf,
)
from engine.zoo.train_lm import train_loop

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
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, B * -(-T // bs), bs, target.dtype,
                          target.device)  # fmt: skip
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
    progress: bool,
) -> dict[str, float]:
    """`train_lm.train_loop` over seeded index batches; returns the smoothed final losses, steps and seconds."""
    stats = train_loop(module, c, _batches(num_rows, c.batch_size, c.steps, seed), loss_fn, desc, progress, "rows")
    if isinstance(module, FeatureHead):
        module.drop_inference_cache()
    return stats


def _subset(n: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A random subset [max(1, fraction * n)] of range(n): the positions whose loss needs the lm_head
    (a [n, V] projection costs as much as the head itself; the feature loss keeps every position)."""
    return torch.randperm(n, generator=gen)[: max(1, round(fraction * n))]


def train_eagle(head: EagleHead, target: Model, windows: torch.Tensor, data: TargetPass, c: EagleConf, seed: int,
                progress: bool = False) -> dict[str, float]:  # fmt: skip
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

    return _fit(head, c.train, windows.shape[0], loss_fn, seed, "eagle", progress)


def train_mtp(head: MTPHead, target: Model, windows: torch.Tensor, data: TargetPass, c: MTPConf, seed: int,
              progress: bool = False) -> dict[str, float]:  # fmt: skip
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

    return _fit(head, c.train, windows.shape[0], loss_fn, seed, "mtp", progress)


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
                    seed: int, progress: bool = False) -> dict[str, float]:  # fmt: skip
    """features [N, D] -> routing expert_ids [N, L, r]: CE against the uniform law on the routed set."""

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        loss = routing_loss(predictor(features[idx]), expert_ids[idx])
        return loss, {"ce": loss.item()}

    return _fit(predictor, c.train, features.shape[0], loss_fn, seed, "predictor", progress)


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
        "params": _params(predictor),
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


# ---------------------------------------------------------------------------------------------- the run
def _windows(streams: dict[str, torch.Tensor], T1: int, max_windows: int | None = None) -> torch.Tensor:
    parts = [corpus_lib.windows(s, T1, max_windows) for s in streams.values()]
    parts = [p for p in parts if p.shape[0]]
    return torch.cat(parts) if parts else torch.empty(0, T1, dtype=torch.long)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def train_all_heads(
    target: Model | str | Path,
    out_dir: str | Path,
    train_streams: dict[str, torch.Tensor],
    heldout_streams: dict[str, torch.Tensor],
    conf: TrainHeadsConf,
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Train EAGLE head, MTP module and expert predictor on `target`; write the three folders; return metrics.

    train_streams / heldout_streams: corpus name -> token stream [N] (engine.corpus.encode_stream)."""
    wall0 = time.perf_counter()
    seconds: dict[str, float] = {}
    if not isinstance(target, Model):
        target = load_model(target)
    target.eval().requires_grad_(False)
    out_dir = Path(out_dir)
    d = conf.data
    T1 = d.seq_len + 1
    gen = torch.Generator().manual_seed(conf.seed)
    train_windows = _windows(train_streams, T1)
    if train_windows.shape[0] > d.train_windows:
        train_windows = train_windows[torch.randperm(train_windows.shape[0], generator=gen)[: d.train_windows]]
    heldout_windows = _windows(heldout_streams, T1, max(1, d.eval_tokens // d.seq_len))
    if heldout_windows.shape[0] == 0:
        raise ValueError(f"no held-out window of {T1} tokens")
    log(f"windows: train {tuple(train_windows.shape)}, held-out {tuple(heldout_windows.shape)}")

    t0 = time.perf_counter()
    train_data = target_pass(target, train_windows)
    heldout_data = target_pass(target, heldout_windows)
    seconds["target_pass"] = time.perf_counter() - t0
    log(f"target pass: {seconds['target_pass']:.0f} s")

    torch.manual_seed(conf.seed)
    eagle = EagleHead(HeadConfig.for_target(target.config, conf.eagle.intermediate_size))
    mtp = MTPHead(HeadConfig.for_target(target.config, conf.mtp.intermediate_size))
    t0 = time.perf_counter()
    eagle_stats = train_eagle(eagle, target, train_windows, train_data, conf.eagle, conf.seed, progress)
    seconds["eagle"] = time.perf_counter() - t0
    log(f"eagle head: {seconds['eagle']:.0f} s, {eagle_stats}")
    t0 = time.perf_counter()
    mtp_stats = train_mtp(mtp, target, train_windows, train_data, conf.mtp, conf.seed + 1, progress)
    seconds["mtp"] = time.perf_counter() - t0
    log(f"mtp module: {seconds['mtp']:.0f} s, {mtp_stats}")
    # everything below uses what ships: the bf16 folders re-loaded into the target's dtype
    paths = {name: out_dir / name for name in HEAD_NAMES}
    save_head(eagle, paths["eagle-head"], target, extra={"objective": "eagle 2401.15077"})
    save_head(mtp, paths["mtp-head"], target, extra={"objective": "mtp 2412.19437"})
    eagle, mtp = load_eagle_head(paths["eagle-head"], target), load_mtp_head(paths["mtp-head"], target)

    # predictor: the EAGLE head's output at position t (what the drafter holds for a node) -> routing at t
    t0 = time.perf_counter()
    sides = ((train_windows, train_data), (heldout_windows, heldout_data))
    feats = [head_outputs(eagle, target, w, data).flatten(0, 1) for w, data in sides]  # [W*(T-1), D]
    ids = [data.expert_ids[:, 1:].flatten(0, 1) for _, data in sides]  # [W*(T-1), L, r]
    predictor = new_expert_predictor(target, feats[0].shape[-1], "eagle", conf.predictor)
    predictor_stats = train_predictor(predictor, feats[0], ids[0], conf.predictor, conf.seed + 2, progress)
    head_info = {"input_head": "eagle-head", "target_weights_sha256": target_digest(target)}
    save_expert_predictor(predictor, paths["expert-predictor"], extra=head_info)
    predictor = load_expert_predictor(paths["expert-predictor"], target.device, target.dtype)
    predictor_metrics = {**predictor_stats, **predictor_report(predictor, feats[1], ids[1], ids[0])}
    seconds["predictor"] = time.perf_counter() - t0
    log(f"expert predictor: {seconds['predictor']:.0f} s, recall {predictor_metrics['topr_recall_per_layer']}")
    dense_metrics = None
    if conf.predictor.dense_drafter:  # a dense drafter's hidden state at position t -> routing at t
        t0 = time.perf_counter()
        drafter = load_model(repo_relative(conf.predictor.dense_drafter))
        feats = [target_pass(drafter, w).features.flatten(0, 1) for w, _ in sides]  # [W*T, D']
        ids = [data.expert_ids.flatten(0, 1) for _, data in sides]  # [W*T, L, r]
        dense = new_expert_predictor(target, feats[0].shape[-1], "dense", conf.predictor)
        dense_stats = train_predictor(dense, feats[0], ids[0], conf.predictor, conf.seed + 3, progress)
        paths["expert-predictor-dense"] = out_dir / "expert-predictor-dense"
        save_expert_predictor(dense, paths["expert-predictor-dense"],
                              extra={"input_drafter": str(conf.predictor.dense_drafter)})  # fmt: skip
        dense = load_expert_predictor(paths["expert-predictor-dense"], target.device, target.dtype)
        dense_metrics = {**dense_stats, **predictor_report(dense, feats[1], ids[1], ids[0])}
        seconds["predictor_dense"] = time.perf_counter() - t0
        log(f"dense-drafter expert predictor: recall {dense_metrics['topr_recall_per_layer']}")

    t0 = time.perf_counter()
    head_metrics = evaluate_heads(eagle, mtp, target, heldout_windows, heldout_data)
    c = conf.eval
    prompts = [w[: c.prompt_len].tolist() for w in heldout_windows[:: max(1, heldout_windows.shape[0] // c.prompts)]]
    drafters = {"eagle": EagleDrafter(eagle, target, predictor), "mtp": MTPDrafter(mtp, target)}
    spec_metrics = speculative_eval(target, drafters, prompts[: c.prompts], c)
    seconds["eval"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - wall0
    metrics = {
        "eagle": {**eagle_stats, **{k: v for k, v in head_metrics.items() if not k.startswith("mtp")},
                  "params": _params(eagle), "speculative": spec_metrics["eagle"]},
        "mtp": {**mtp_stats, **{k: v for k, v in head_metrics.items() if k.startswith("mtp") or k == "positions"},
                "params": _params(mtp), "speculative": spec_metrics["mtp"]},
        "expert_predictor": predictor_metrics,
        "data": {"train_windows": list(train_windows.shape), "heldout_windows": list(heldout_windows.shape)},
        "seconds": seconds,
        "seed": conf.seed,
    }  # fmt: skip
    keys = {"eagle-head": "eagle", "mtp-head": "mtp", "expert-predictor": "expert_predictor"}
    if dense_metrics is not None:
        metrics["expert_predictor_dense"] = dense_metrics
        keys["expert-predictor-dense"] = "expert_predictor_dense"
    for name, key in keys.items():
        (paths[name] / "metrics.json").write_text(json.dumps(metrics[key], indent=2, sort_keys=True) + "\n")
    metrics["bytes"] = {name: _folder_bytes(p) for name, p in paths.items()}
    return metrics


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())



def corpus_streams(target: Model, d: DataConf) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The zoo corpus split tokenised with the target's tokenizer -> (train, held-out) streams per corpus."""
    if target.tokenizer is None:
        raise ValueError(f"the target at {target.path} has no tokenizer.json")
    shared = repo_relative(d.shared_data)
    shared = shared if shared is not None and (shared / "corpus").is_dir() else None
    split = corpus_lib.assemble_corpus(shared, d.heldout_fraction, d.chunk_chars, dict(d.train_chars),
                                      dict(d.heldout_chars))  # fmt: skip
    train = {c: corpus_lib.encode_stream(target.tokenizer, split.train.get(c, [])) for c in split.corpora}
    heldout = {c: corpus_lib.encode_stream(target.tokenizer, split.heldout.get(c, [])) for c in split.corpora}
    return train, heldout


def byte_streams(d: DataConf) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Smoke data: the English help topics as UTF-8 bytes (vocab 256), split by document name."""
    split = corpus_lib.split_corpus(corpus_lib.english_documents(d.chunk_chars), d.heldout_fraction)
    as_bytes = lambda docs: torch.tensor(list("".join(x.text for x in docs).encode()), dtype=torch.long)  # noqa: E731
    return {"english": as_bytes(split.train["english"])}, {"english": as_bytes(split.heldout["english"])}


def run(conf: TrainHeadsConf, progress: bool = False, log: Callable[[str], None] = lambda s: None) -> dict:
    """Resolve target, data and out_dir from `conf` (smoke or real) and train all heads."""
    torch.set_num_threads(conf.threads)
    if conf.smoke:
        conf = smoke_conf(conf)
        target = smoke_target(conf.seed)
        train, heldout = byte_streams(conf.data)
        out_dir = Path(tempfile.mkdtemp(prefix="expertspec-heads-smoke-"))
    else:

        target = load_model(repo_relative(conf.target) if conf.target else zoo_path("tiny-moe"))
        train, heldout = corpus_streams(target, conf.data)
        out_dir = Path(to_absolute_path(conf.out_dir))
    log(f"target {target.path or 'random smoke target'}; out_dir {out_dir}")
    metrics = train_all_heads(target, out_dir, train, heldout, conf, progress, log)
    metrics["out_dir"] = str(out_dir)
    return metrics


@hydra.main(config_path="../../conf", config_name="train_heads", version_base=None)
def main(cfg) -> None:
    conf: TrainHeadsConf = OmegaConf.to_object(cfg)
    m = run(conf, progress=conf.progress, log=tqdm.write)
    e, t, p = m["eagle"], m["mtp"], m["expert_predictor"]
    print(f"\nheads -> {m['out_dir']}  (held-out positions: {e['positions']})")
    print(
        f"EAGLE head: top-1 agreement with the target {e['eagle_top1_agreement']:.3f} "
        f"(text accuracy {e['eagle_top1_accuracy']:.3f}; target's own {e['target_top1_accuracy']:.3f})"
    )
    print(
        f"MTP module: top-1 accuracy for t+2 {t['mtp_top1_accuracy_t2']:.3f}, "
        f"agreement with the target's t+2 argmax {t['mtp_top1_agreement_t2']:.3f}"
    )
    print(
        f"expert predictor top-r recall per layer: "
        f"{p['topr_recall_per_layer']} (mean {p['topr_recall_mean']:.3f}; random {p['random_baseline']:.3f}; "
        f"popularity {p['popularity_baseline_per_layer']})"
    )
    if "expert_predictor_dense" in m:
        q = m["expert_predictor_dense"]
        print(f"dense-drafter expert predictor top-r recall per layer: {q['topr_recall_per_layer']}")
    for name in ("eagle", "mtp"):
        for spec, s in m[name]["speculative"].items():
            print(
                f"  {name:<5} {spec:<26} tau {s['tau']:.2f}  verified/round {s['verified_per_round']:.1f}  "
                f"experts/layer {s['distinct_experts_per_layer']:.2f}  exact {s['exact']}"
            )
    print(f"bytes: {m['bytes']}")
    print(f"seconds: {', '.join(f'{k} {v:.0f}' for k, v in m['seconds'].items())}")
    if not math.isfinite(e["final_reg"]):
        raise SystemExit("EAGLE training diverged")


if __name__ == "__main__":
    main()
