"""The multi-token-prediction (MTP) modules shipped inside DeepSeek-V3 / R1 and GLM-4.5 checkpoints (2412.19437 §2.2).

A checkpoint with `num_nextn_predict_layers` = n stores n modules after its L decoder layers, as extra layers:

    model.layers.{L+k}.enorm / hnorm              RMSNorm [D]
    model.layers.{L+k}.eh_proj                    Linear [2D] -> [D], no bias
    model.layers.{L+k}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*   one decoder layer of the
                                                  target's family (MLA + MoE for DeepSeek-V3)
    model.layers.{L+k}.shared_head.norm           RMSNorm [D]
    model.layers.{L+k}.shared_head.head           [V, D]  (a copy of lm_head; optional here)
    model.layers.{L+k}.embed_tokens               [V, D]  (a copy of the embedding; optional here)

Forward of module k at position t, h_t the feature it reads and x_{t+1} the token after t:

    u_t  = eh_proj([enorm(emb(x_{t+1})) ; hnorm(h_t)])          embedding first (vLLM, SGLang, transformers)
    o_t  = shared_head.norm(block(u_t))                          the feature this module outputs
    P(x_{t+2}) = softmax(shared_head.head(o_t))

h_t of the first module is the target's final hidden state after its final norm (`ForwardOutput.hidden`,
as transformers' MTP generator and the serving engines feed it). Chained drafting for K > 1 feeds o_t back
as the next depth's h (the normalised output, as transformers and SGLang chain; vLLM feeds the
pre-norm output instead), i.e. the EAGLE recursion `engine.drafting.mtp_drafter.CheckpointMTPDrafter` runs.
RoPE is relative, so the module's position convention (t or t + 1) does not change its outputs.

Only the first module is used (n = 1 is what DeepSeek-V3 / R1 and GLM-4.5 ship); n > 1 is refused.

Shape letters: N=packed tokens B=batch T=tokens D=hidden V=vocab.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from engine.models.checkpoint import CheckpointError, _to_internal, check_state, read_weights, split_extra_layers
from engine.models.config import ModelConfig
from engine.models.kv_cache import PagedKVCache
from engine.models.layers import RMSNorm, sign_sin
from engine.models.rope import rope_table
from engine.models.transformer import DecoderLayer, ForwardBatch, Model

MTP_FAMILIES = ("deepseek_v3", "glm4_moe")
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # the module's own weights; the rest: block


class CheckpointMTP(nn.Module):
    """One shipped MTP module, a `FeatureHead`-compatible head for `engine.drafting.feature_drafter`."""

    feature_space = "mtp_checkpoint"

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        D, V, eps = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps
        moe = cfg.is_moe and layer >= min(cfg.moe_layers)  # DeepSeek-V3: every layer after the dense ones is MoE
        self.config = dataclasses.replace(cfg, num_layers=layer + 1,
                                          moe_layers=(*cfg.moe_layers, layer) if moe else ())  # fmt: skip
        self.layer_index = layer
        self.enorm, self.hnorm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = DecoderLayer(self.config, layer)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, eps)
        self.shared_head.head = nn.Linear(D, V, bias=False)
        self.embed_tokens = nn.Embedding(V, D)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """h_t, emb(x_{t+1}) [..., D] -> u_t [..., D]."""
        return self.eh_proj(torch.cat([self.enorm(token_emb.to(features.dtype)), self.hnorm(features)], dim=-1))

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        return out  # o_t is already shared_head.norm'ed

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """o_t [..., D] -> draft logits [..., V]."""
        return self.shared_head.head(out)

    def forward(self, features: torch.Tensor, token_emb: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Causal forward without cache: h, emb(next tokens) [B, T, D] at positions start.. -> o [B, T, D]."""
        b = self.block
        x = self.fuse(features, token_emb)
        cos, sin = rope_table(self.config, torch.arange(start, start + x.shape[1], device=x.device), x.dtype)
        h = x + b.self_attn.forward_plain(b.input_layernorm(x), cos, sin)
        B, T, D = h.shape
        h = h + b.mlp_forward(b.post_attention_layernorm(h).reshape(B * T, D), None, None, None).view(B, T, D)
        return self.shared_head.norm(h)

    def forward_cached(
        self, features: torch.Tensor, token_emb: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache
    ) -> torch.Tensor:
        """Packed forward over the module's one-layer paged cache: h, emb [N, D] -> o [N, D]."""
        b = self.block
        x = self.fuse(features, token_emb)
        cos, sin = rope_table(self.config, batch.positions, x.dtype)
        h = x + b.self_attn.forward_cached(b.input_layernorm(x), cos, sign_sin(sin), batch, kv, 0)
        h = h + b.mlp_forward(b.post_attention_layernorm(h), None, None, None)
        return self.shared_head.norm(h)

    def new_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> PagedKVCache:
        """The module's own paged cache (one layer; MLA: the latent layout)."""
        return PagedKVCache.for_model(dataclasses.replace(self.config, num_layers=1), num_blocks, block_size, dtype,
                                      device)  # fmt: skip


def load_checkpoint_mtp(target: Model, path: str | os.PathLike | None = None) -> CheckpointMTP:
    """The first MTP module of the target's own checkpoint folder (default `target.path`), on the target's
    device and dtype. Every tensor of the module is accounted for: a missing or unexpected one (or a wrong
    shape) is a `CheckpointError` naming it. `shared_head.head` / `embed_tokens` copies are optional (the
    target's lm_head / embedding stand in)."""
    cfg = target.config
    if path is None:
        path = target.path
    if path is None:
        raise ValueError("drafter='mtp' reads the MTP layers from the target's checkpoint folder: load the target "
                         "with engine.load_model(folder)")  # fmt: skip
    if cfg.model_type not in MTP_FAMILIES:
        raise ValueError(f"drafter='mtp' needs a {' / '.join(MTP_FAMILIES)} target, this one is {cfg.model_type}")
    n = cfg.num_nextn_predict_layers
    if n > 1:
        raise NotImplementedError(f"{path}: {n} MTP modules; only one (num_nextn_predict_layers=1) is supported")
    L = cfg.num_layers
    extra = split_extra_layers(cfg, read_weights(cfg, Path(path)))[1]
    prefix = f"model.layers.{L}."
    if n < 1 or not any(k.startswith(prefix) for k in extra):
        raise CheckpointError(f"{path} has no MTP weights (num_nextn_predict_layers={n}, no {prefix}* tensors): "
                              "drafter='mtp' needs a checkpoint that ships its MTP module")  # fmt: skip
    others = sorted(k for k in extra if not k.startswith(prefix))
    if others:
        raise CheckpointError(f"{path}: unexpected tensors beyond the MTP module: {others[:8]}")
    state = {}
    for key, t in _to_internal(cfg, extra).items():
        name = key[len(prefix) :]
        state[name if name.startswith(_OWN) else f"block.{name}"] = t
    with torch.device("meta"):
        module = CheckpointMTP(cfg, L)
    expected = module.state_dict()
    state.setdefault("shared_head.head.weight", target.lm_head.weight.detach())  # optional copies
    state.setdefault("embed_tokens.weight", target.model.embed_tokens.weight.detach())

    check_state(state, expected, path, "MTP module weights",  # in checkpoint names (stacked experts: our name)
                name=lambda k: prefix + k.removeprefix("block."))  # fmt: skip
    module = module.to_empty(device=target.device)
    module.load_state_dict({k: v.to(target.dtype) for k, v in state.items()})
    return module.to(target.dtype).eval().requires_grad_(False)
