"""Training the fine-grained `deepseek_v3` zoo target and its own MTP module (`python -m engine.zoo.fine`).

DeepSeek-V3's router (2412.19437 §2.1.2, engine.models.routing) picks experts by sigmoid score + a per-expert
correction bias; the bias is not trained by gradients. Auxiliary-loss-free balancing (2408.15664) moves it after
every step, for every MoE layer:

    load_e  = assignments of expert e in the step's batch          (the routing the forward really used)
    bias_e += u * sign(mean_e' load_e' - load_e)                    u = bias_update_speed

plus DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20, weight alpha, per sequence of T tokens):

    s'_{e,t} = s_{e,t} / sum_e' s_{e',t}        P_e = mean_t s'_{e,t}        f_e = E / (r T) * #{t : e in top-r(t)}
    L_bal    = sum_e f_e P_e                     (= 1 for perfectly balanced routing and scores)

- `padded_expert_compute`: a training `ExpertFn` (the MoE block's `expert_fn` hook) with the math of
  `kernels.fused_moe_ref`, as two batched matmuls over experts padded to the largest load: ~3x faster with
  autograd at 64 experts than one matmul pair per expert (whose weight slices each allocate a full-size grad);
- `routed_forward`: the plain causal forward of `Model.forward`, also returning the routing and router logits;
- `train_fine_target`: CE + alpha * L_bal, bias updates, through `train_lm.train_loop`;
- `new_checkpoint_mtp`, `train_checkpoint_mtp`: the target's MTP module in the DeepSeek-V3 checkpoint layout
  (`engine.models.mtp.CheckpointMTP`, one MLA + MoE block) trained on the frozen target's features, with the
  same balancing, reading the target's embedding and output head;
- `mtp_hub_state`, `save_with_mtp`: the module written into the target's folder as `model.layers.{L}.*`, so
  `Engine(target, drafter="mtp")` loads it (without copies of the embedding / head: the target's stand in).

Shape letters: B=batch T=sequence length V=vocab D=hidden E=experts r=top-r F=expert dim C=capacity (largest
load) A=assignments W=windows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.checkpoint import init_weights, save_model
from engine.models.moe import MoEBlock, RoutingRecord
from engine.models.mtp import CheckpointMTP
from engine.models.rope import rope_table
from engine.models.transformer import Model
from engine.zoo.configs import FineMTPConf, FineTargetConf
from engine.zoo.head_objectives import TargetPass, _batches, _subset
from engine.zoo.train_lm import OnStep, batches, train_loop


# ---------------------------------------------------------------------------------------------- experts
def padded_expert_compute(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """`kernels.fused_moe_ref`'s math (an `ExpertFn`) as two bmm over experts padded to capacity C = largest load.

    x [T, D], w_gate_up [E, 2F, D], w_down [E, D, F], expert_ids [T, r] (-1 = contributes 0), topk_weights [T, r]
    -> [T, D] in x's dtype. Differentiable w.r.t. x, both weights and topk_weights."""
    T, D = x.shape
    E, r = w_gate_up.shape[0], expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [A]
    order = flat.argsort(stable=True)
    order = order[flat[order] >= 0]  # [A_local] grouped by expert
    if order.numel() == 0:
        return x.new_zeros(T, D)
    expert = flat[order]
    counts = torch.bincount(expert, minlength=E)  # [E]
    slot = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert]  # rank inside e
    tokens = order // r
    xin = x.new_zeros(E, int(counts.max()), D).index_put((expert, slot), x.index_select(0, tokens))  # [E, C, D]
    gate, up = torch.bmm(xin, w_gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, F]
    y = torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2))[expert, slot]  # [A_local, D]
    y = y * topk_weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)
    return x.new_zeros(T, D).index_add(0, tokens, y.to(x.dtype))


@contextmanager
def training_experts(model: torch.nn.Module) -> Iterator[None]:
    """Route every MoE block of `model` through `padded_expert_compute` for the duration (then back)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    saved = [b.expert_fn for b in blocks]
    for b in blocks:
        b.expert_fn = padded_expert_compute
    try:
        yield
    finally:
        for b, fn in zip(blocks, saved):
            b.expert_fn = fn


# ---------------------------------------------------------------------------------------------- balancing
def seq_balance_loss(router_logits: list[torch.Tensor], expert_ids: list[torch.Tensor], batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (module docstring), averaged over sequences and MoE layers.

    router_logits: one [B*T, E] per MoE layer; expert_ids: one [B*T, r] per layer; batch = B."""
    losses = []
    for logits, ids in zip(router_logits, expert_ids):
        E, r = logits.shape[-1], ids.shape[-1]
        scores = torch.sigmoid(logits.float()).view(batch, -1, E)  # [B, T, E]
        T = scores.shape[1]
        share = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [B, E] P_e
        hits = torch.zeros(batch, E, device=logits.device).scatter_add_(
            1, ids.view(batch, T * r), torch.ones(batch, T * r, device=logits.device)
        )  # [B, E] assignments per sequence
        losses.append((hits * (E / (r * T)) * share).sum(-1).mean())
    return torch.stack(losses).mean()


@torch.no_grad()
def update_correction_bias(blocks: list[MoEBlock], expert_ids: list[torch.Tensor], speed: float) -> float:
    """bias_e += speed * sign(mean load - load_e) per block (its routing expert_ids [N, r]); returns the mean over
    layers of max load / mean load before the update (1.0 = perfectly balanced)."""
    imbalance = []
    for block, ids in zip(blocks, expert_ids):
        load = torch.bincount(ids.reshape(-1), minlength=block.num_experts).float()  # [E]
        block.gate.e_score_correction_bias.add_(speed * torch.sign(load.mean() - load))
        imbalance.append(float(load.max() / load.mean()))
    return sum(imbalance) / max(len(imbalance), 1)


# ---------------------------------------------------------------------------------------------- target
def routed_forward(
    model: Model, input_ids: torch.Tensor, record: RoutingRecord, router_logits: list[torch.Tensor]
) -> torch.Tensor:
    """`Model.forward` (input_ids [B, T] -> logits [B, T, V]) that also fills `record` (expert_ids per MoE layer,
    [B*T, r]) and `router_logits` ([B*T, E] per MoE layer)."""
    B, T = input_ids.shape
    h = model.model.embed_tokens(input_ids)
    cos, sin = rope_table(model.config, torch.arange(T, device=input_ids.device), h.dtype)
    for layer in model.model.layers:
        h = h + layer.self_attn.forward_plain(layer.input_layernorm(h), cos, sin)
        x = layer.post_attention_layernorm(h).reshape(B * T, -1)
        h = h + layer.mlp_forward(x, record, router_logits, None).view(B, T, -1)
    return model.lm_head(model.model.norm(h))


def train_fine_target(
    model: Model, windows: torch.Tensor, c: FineTargetConf, seed: int, bf16: bool, on_step: OnStep | None = None
) -> dict[str, float]:
    """Next-token CE + seq_aux_loss_coef * L_bal on windows [W, T+1], correction biases updated every step."""
    blocks = model.moe_blocks

    def loss_fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        record, router_logits = RoutingRecord(), []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            target_logits = routed_forward(model, batch[:, :-1], record, router_logits)  # [B, T, V]
        ce = F.cross_entropy(target_logits.float().flatten(0, 1), batch[:, 1:].flatten())
        bal = seq_balance_loss(router_logits, record.expert_ids, batch.shape[0])
        imbalance = update_correction_bias(blocks, record.expert_ids, c.bias_update_speed)
        return ce + c.seq_aux_loss_coef * bal, {"ce": ce.item(), "bal": bal.item(), "imbalance": imbalance}

    with training_experts(model):
        return train_loop(model, c.train, batches(windows, c.train.batch_size, c.train.steps, seed), loss_fn,
                          "target", on_step)  # fmt: skip


# ---------------------------------------------------------------------------------------------- MTP module
def new_checkpoint_mtp(target: Model, seed: int) -> CheckpointMTP:
    """A randomly initialised MTP module (layer num_hidden_layers of the target's family) whose embedding and
    output head are the target's, frozen."""
    mtp = init_weights(CheckpointMTP(target.config, target.config.num_layers), seed)  # type: ignore[arg-type]
    with torch.no_grad():
        mtp.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        mtp.shared_head.head.weight.copy_(target.lm_head.weight)
    mtp.embed_tokens.requires_grad_(False)
    mtp.shared_head.head.requires_grad_(False)
    return mtp.to(target.dtype)


def mtp_forward(
    mtp: CheckpointMTP,
    features: torch.Tensor,
    token_emb: torch.Tensor,
    record: RoutingRecord | None = None,
    router_logits: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`CheckpointMTP.forward` (h, emb(x_{t+1}) [B, T, D] -> o [B, T, D]) that also records its routing."""
    b = mtp.block
    x = mtp.fuse(features, token_emb)
    B, T, D = x.shape
    cos, sin = rope_table(mtp.config, torch.arange(T, device=x.device), x.dtype)
    h = x + b.self_attn.forward_plain(b.input_layernorm(x), cos, sin)
    h = h + b.mlp_forward(b.post_attention_layernorm(h).reshape(B * T, D), record, router_logits, None).view(B, T, D)
    return mtp.shared_head.norm(h)


def train_checkpoint_mtp(
    mtp: CheckpointMTP,
    target: Model,
    windows: torch.Tensor,
    data: TargetPass,
    c: FineMTPConf,
    seq_aux_loss_coef: float,
    bias_update_speed: float,
    seed: int,
    bf16: bool,
    on_step: OnStep | None = None,
) -> dict[str, float]:
    """CE(x_{t+2}) from (h_t, emb(x_{t+1})), t = 0..T-2, + target_kl_weight * CE against the target's law of
    x_{t+2} (lm_head(h_{t+1})); windows [W, T+1], data.features [W, T, D] (the frozen target's final hidden)."""
    gen = torch.Generator().manual_seed(seed + 17)
    T = windows.shape[1] - 1
    blocks = [mtp.block.mlp] if isinstance(mtp.block.mlp, MoEBlock) else []

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        record, router_logits = RoutingRecord(), []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            emb = mtp.embed_tokens(windows[idx, 1:T])  # [B, T-1, D]
            out = mtp_forward(mtp, data.features[idx, :-1], emb, record, router_logits).flatten(0, 1)  # [B*(T-1), D]
            sel = _subset(out.shape[0], c.loss_fraction, gen)
            logits = mtp.logits(out[sel]).float()  # [n, V]
        ce = F.cross_entropy(logits, windows[idx, 2:].flatten()[sel])
        loss, parts = ce, {"ce": ce.item()}
        if c.target_kl_weight > 0:
            with torch.no_grad():  # the target's law of x_{t+2}
                target_probs = torch.softmax(target.lm_head(data.features[idx, 1:].flatten(0, 1)[sel]), dim=-1)
            distill = -(target_probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            loss, parts["distill"] = loss + c.target_kl_weight * distill, distill.item()
        if blocks:
            bal = seq_balance_loss(router_logits, record.expert_ids, idx.numel())
            parts["imbalance"] = update_correction_bias(blocks, record.expert_ids, bias_update_speed)
            loss = loss + seq_aux_loss_coef * bal
        return loss, parts

    with training_experts(mtp):
        return train_loop(mtp, c.train, _batches(windows.shape[0], c.train.batch_size, c.train.steps, seed), loss_fn,
                          "mtp", on_step, "rows")  # fmt: skip


# ---------------------------------------------------------------------------------------------- saving
_NOT_SHIPPED = ("embed_tokens.", "shared_head.head.")  # copies of the target's tensors: the loader substitutes them


def mtp_hub_state(mtp: CheckpointMTP, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The module's tensors under their DeepSeek-V3 checkpoint names (`model.layers.{L}.enorm.weight`, per-expert
    `mlp.experts.{e}.gate_proj.weight`, `mlp.shared_experts.*`, `mlp.gate.e_score_correction_bias`, ...)."""
    prefix = f"model.layers.{mtp.layer_index}."
    out: dict[str, torch.Tensor] = {}
    for key, t in mtp.state_dict().items():
        if key.startswith(_NOT_SHIPPED):
            continue
        t = t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype)
        name = key.removeprefix("block.").replace("mlp.shared_expert.", "mlp.shared_experts.")
        if name == "mlp.experts.gate_up_proj":  # [E, 2F, D]: rows 0..F-1 gate, F..2F-1 up
            F_ = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :F_].contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, F_:].contiguous()
        elif name == "mlp.experts.down_proj":  # [E, D, F]
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[prefix + name] = t.contiguous()
    return out


def save_with_mtp(
    target: Model,
    mtp: CheckpointMTP,
    path: str | os.PathLike,
    dtype: torch.dtype,
    tokenizer_json: str | os.PathLike | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """The target's HF folder with its MTP module as layer num_hidden_layers (config: num_nextn_predict_layers=1)."""
    if target.config.num_nextn_predict_layers != 1 or mtp.layer_index != target.config.num_layers:
        raise ValueError("save_with_mtp needs a target whose config declares num_nextn_predict_layers=1 and its "
                         f"module at layer {target.config.num_layers}, got {mtp.layer_index}")  # fmt: skip
    return save_model(target, path, dtype, tokenizer_json, extra_files, extra_tensors=mtp_hub_state(mtp, dtype))
