"""Feature heads over a frozen target: the EAGLE head (2401.15077) and the DeepSeek-V3 MTP module (2412.19437).

One decoder layer over a fusion of the target feature f_t and the embedding of the next token; the drafting
recursion over them lives in engine.drafting.feature_drafter. Saved as small HF-style folders that record the
target's weight digest (a head refuses a retrained target).

MTP:
    h'_t = M [RMSNorm(h_t) ; RMSNorm(emb(x_{t+1}))]      M: [2D] -> [D], no bias
    o_t  = TRM(h'_t)                                     one transformer block (engine.model.DecoderLayer)
    P(x_{t+2}) = softmax(lm_head(RMSNorm(o_t)))          the target's shared, frozen output head

h_t is the target's final feature at position t (whose own head predicts x_{t+1}), so the module sees the
next token and predicts the one after it; it is trained with cross-entropy on x_{t+2} over a frozen
target (engine/train_heads.py). DeepSeek-V3 chains D sequential modules, module k reading module k-1's
output o; we apply the one trained module recursively (o_t is the next depth's h), which is exactly the
EAGLE drafting recursion, so `MTPDrafter` is `engine.eagle.EagleDrafter` over an `MTPHead`: same KV
alignment (true target features at start/commit), tree expansion, drafted/deterministic children and
expert-aware selection. The difference to EAGLE is the fusion (normalised inputs, no bias), the output
norm, and the training objective (next-next token, not feature regression).

Shape letters: D=hidden.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file
from torch import nn

from engine.models.checkpoint import save_module_folder
from engine.models.config import ModelConfig, parse_config
from engine.models.kv_cache import PagedKVCache
from engine.models.layers import add_norm, sign_sin
from engine.models.transformer import DecoderLayer, ForwardBatch, Model, RMSNorm, rope_cos_sin
from kernels.small_m import linear


@dataclass(frozen=True)
class HeadConfig:
    """Sizes of a feature head; attention geometry and RoPE follow the target's."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @staticmethod
    def for_target(target: ModelConfig, intermediate_size: int) -> HeadConfig:
        return HeadConfig(
            hidden_size=target.hidden_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=intermediate_size,
            vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
        )

    def layer_config(self) -> ModelConfig:
        """A one-layer dense (llama) `ModelConfig` for `engine.model.DecoderLayer`."""
        return parse_config(
            dict(
                model_type="llama",
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
                num_hidden_layers=1,
                num_attention_heads=self.num_heads,
                num_key_value_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                rms_norm_eps=self.rms_norm_eps,
                rope_theta=self.rope_theta,
                max_position_embeddings=self.max_position_embeddings,
            )
        )


class FeatureHead(nn.Module):
    """One decoder layer over `fuse(features, token_emb)`; subclasses define `fuse` and `readout`."""

    model_type: ClassVar[str] = ""
    feature_space: ClassVar[str] = ""  # what its outputs mean (an ExpertPredictor's `input` must match)

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layer = DecoderLayer(cfg.layer_config(), 0)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """features, token_emb [..., D] -> layer input [..., D]."""
        raise NotImplementedError

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """Head output [..., D] -> what the target's lm_head reads [..., D]."""
        return out

    def _block(self, x: torch.Tensor, attend) -> torch.Tensor:
        layer = self.layer
        h = x + attend(layer.input_layernorm(x))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, features: torch.Tensor, token_emb: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Causal forward without cache (training): features, token_emb [B, T, D] -> out [B, T, D].

        Row t is the input (f_t, emb(x_{t+1})) at position start + t."""
        cfg = self.config
        x = self.fuse(features, token_emb)
        pos = torch.arange(start, start + x.shape[1], device=x.device)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        return self._block(x, lambda y: self.layer.self_attn.forward_plain(y, cos, sin))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sign-folded sin [N, hd] (`apply_rope_signed`), rows of a table built once per
        dtype and device over max_position_embeddings (as `Model.forward_batch` reads the target's)."""
        table = self.__dict__.get("_rope_table")
        if table is None or table[0].dtype != dtype or table[0].device != positions.device:
            cfg = self.config
            pos = torch.arange(cfg.max_position_embeddings, device=positions.device)
            cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, dtype)
            table = self.__dict__["_rope_table"] = (cos, sign_sin(sin))
        return table[0][positions], table[1][positions]

    def forward_cached(
        self, features: torch.Tensor, token_emb: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache
    ) -> torch.Tensor:
        """Packed forward over the head's paged KV (one layer): features, token_emb [N, D] -> out [N, D].

        The drafting step: the residual adds fused into the norms (`add_norm`, one C++ call each on CPU fp32) and
        the RoPE rows read from a table; the same function as `forward` (tested to 1e-4)."""
        x = self.fuse(features, token_emb)
        cos, sin_signed = self._rope(batch.positions, x.dtype)
        layer = self.layer
        h, y = add_norm(layer.input_layernorm, x, None)
        attn = layer.self_attn.forward_cached(y, cos, sin_signed, batch, kv, 0)
        h, y = add_norm(layer.post_attention_layernorm, h, attn)
        return h + layer.mlp.forward(y)


class EagleHead(FeatureHead):
    """EAGLE (2401.15077 §4.1): fc([f_t ; emb(x_{t+1})]) -> decoder layer -> f^_{t+1}; logits = lm_head(f^)."""

    model_type: ClassVar[str] = "expertspec_eagle"
    feature_space: ClassVar[str] = "eagle"

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        x = torch.cat([features, token_emb.to(features.dtype)], dim=-1)
        if torch.is_grad_enabled() or x.dim() != 2:
            return self.fc(x)
        return linear(x, self.fc.weight, self.fc.bias, pack=True)  # inference: the small-M kernel, not BLAS


def save_head(head: FeatureHead, path: str | os.PathLike, target: Model, dtype: torch.dtype = torch.bfloat16,
              extra: dict | None = None) -> Path:  # fmt: skip
    """HF-like folder: config.json (`model_type` expertspec_eagle / expertspec_mtp) + model.safetensors.

    Only the head's own weights are saved; embeddings and lm_head are the target's."""
    tcfg = target.config
    config = {
        "model_type": head.model_type,
        **asdict(head.config),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "target": {"model_type": tcfg.model_type, "hidden_size": tcfg.hidden_size,
                   "vocab_size": tcfg.vocab_size, "num_layers": tcfg.num_layers,
                   "weights_sha256": target_digest(target)},
        **(extra or {}),
    }  # fmt: skip
    return save_module_folder(path, config, head, dtype)


def target_digest(target: Model) -> str | None:
    """SHA-256 (16 hex digits) of the target checkpoint's *.safetensors files; None for an in-memory model.

    A head is only valid for the exact weights it was trained on (it regresses their features)."""
    if target.path is None:
        return None
    digest = hashlib.sha256()
    for file in sorted(Path(target.path).glob("*.safetensors")):
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def load_head(path: str | os.PathLike, target: Model, cls: type[FeatureHead]) -> FeatureHead:
    """Load a head folder of class `cls` for `target` (its device and dtype); checks the pairing: sizes,
    and the target checkpoint's digest when both sides know it (a retrained target needs retrained heads)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    raw = json.loads(file.read_text())
    if raw.get("model_type") != cls.model_type:
        raise ValueError(f"{path} holds a {raw.get('model_type')!r} model, expected {cls.model_type!r}")
    fields = {k: raw[k] for k in HeadConfig.__dataclass_fields__ if k in raw}
    cfg = HeadConfig(**fields)
    tcfg = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(
            f"{path} was trained for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, the target has "
            f"hidden {tcfg.hidden_size} / vocab {tcfg.vocab_size}"
        )
    trained_on = raw.get("target", {}).get("weights_sha256")
    if trained_on is not None and target.path is not None and trained_on != target_digest(target):
        raise ValueError(
            f"{path} was trained on another target checkpoint (weights {trained_on}, {target.path} has "
            f"{target_digest(target)}): retrain the heads with `python -m engine.zoo.train_heads`"
        )
    head = cls(cfg)
    state = load_file(str(path / "model.safetensors"))
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def load_eagle_head(path: str | os.PathLike, target: Model) -> EagleHead:
    """`zoo/eagle-head` -> EagleHead on the target's device and dtype."""
    return load_head(path, target, EagleHead)  # type: ignore[return-value]


class MTPHead(FeatureHead):
    """The MTP module; parameter names follow DeepSeek-V3's (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`)."""

    model_type: ClassVar[str] = "expertspec_mtp"
    feature_space: ClassVar[str] = "mtp"

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        D = cfg.hidden_size
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.out_norm = RMSNorm(D, cfg.rms_norm_eps)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """features (h_t), token_emb (emb(x_{t+1})) [..., D] -> h'_t [..., D]."""
        return self.eh_proj(torch.cat([self.hnorm(features), self.enorm(token_emb.to(features.dtype))], dim=-1))

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """o_t [..., D] -> RMSNorm(o_t), what the shared lm_head reads."""
        return self.out_norm(out)


def load_mtp_head(path: str | os.PathLike, target: Model) -> MTPHead:
    """`zoo/mtp-head` -> MTPHead on the target's device and dtype."""
    return load_head(path, target, MTPHead)  # type: ignore[return-value]
