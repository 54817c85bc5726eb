"""EAGLE-3 draft heads (2503.01840) in the layout SpecForge trains and SGLang / vLLM load (`LlamaForCausalLMEagle3`).

A head folder holds config.json (a llama config with `architectures: ["LlamaForCausalLMEagle3"]`,
`num_hidden_layers: 1`, `draft_vocab_size`, optional `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors (or pytorch_model.bin) with:

    fc.weight                         [D, 3 Dt]   fuses three target layers' hidden states (bias iff config.bias)
    midlayer.input_layernorm.weight   [D]         on the token embedding
    midlayer.hidden_norm.weight       [D]         on the fused / previous feature
    midlayer.self_attn.{q,k,v}_proj   [.., 2D]    attention input: [embedding ; feature]
    midlayer.self_attn.o_proj         [D, H hd]
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj   a llama SwiGLU block
    norm.weight                       [D]
    lm_head.weight                    [Vd, D]     the reduced draft vocabulary (absent: the target's lm_head)
    d2t [Vd] int64, t2d [V] bool      draft id i is target id i + d2t[i]; t2d marks the target ids kept
    embed_tokens.weight               [V, D]      optional (absent: the target's embedding)

One step at position t (g_t the feature it reads, x_{t+1} the next token):

    g_t      = fc([a^1_t ; a^2_t ; a^3_t])      first step: the target's auxiliary states (below)
    r        = g_t  (hidden_norm(g_t) if norm_before_residual)
    r        = r + attn([input_layernorm(emb(x_{t+1})) ; hidden_norm(g_t)])
    p_t      = r + mlp(post_attention_layernorm(r))        the pre-norm output: next depth's feature
    logits   = lm_head(norm(p_t)) [Vd] -> target ids d2t (every other target id: -inf)

Auxiliary states: the residual stream entering target layers c_j (transformers' `hidden_states[c_j]`), with
c = [id + 1 for id in eagle_aux_hidden_state_layer_ids] or, without ids, [2, L // 2, L - 3] (SGLang's and
vLLM's default), concatenated in that order (`Model.forward_batch(feature_layers=c)`).

Shape letters: B=batch T=tokens N=packed tokens D=head hidden Dt=target hidden V=vocab Vd=draft vocab.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from engine.models.checkpoint import check_state
from engine.models.config import ModelConfig, parse_config
from engine.models.kv_cache import PagedKVCache
from engine.models.layers import RMSNorm, sign_sin
from engine.models.rope import rope_table
from engine.models.transformer import DecoderLayer, ForwardBatch, Model

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Error(ValueError):
    """An EAGLE-3 head folder that does not fit its target (or is malformed)."""


@dataclass(frozen=True)
class Eagle3Config:
    """`layer`: the llama config of the decoder layer. `hidden_size` is the TARGET hidden size the head
    reads (what a drafter checks against its target); `layer.hidden_size` is the head's own width."""

    layer: ModelConfig
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False
    fc_bias: bool = False

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layers whose INPUT hidden states feed `fc` (see the module docstring)."""
        L = num_target_layers
        layers = (2, L // 2, L - 3) if self.aux_layer_ids is None else tuple(i + 1 for i in self.aux_layer_ids)
        if len(layers) != 3 or any(not 0 <= c <= L for c in layers):
            raise Eagle3Error(
                f"EAGLE-3 auxiliary layers {self.aux_layer_ids or 'default [2, L//2, L-3]'} do not fit a target "
                f"with {L} layers (need three captured inputs in 0..{L})"
            )
        return layers


def is_eagle3_config(raw: dict) -> bool:
    return any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or [])


def parse_eagle3_config(raw: dict) -> Eagle3Config:
    """config.json of a `LlamaForCausalLMEagle3` head -> `Eagle3Config` (errors name the field)."""
    if not is_eagle3_config(raw):
        raise Eagle3Error(f"not an EAGLE-3 head: architectures {raw.get('architectures')}")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise Eagle3Error(f"EAGLE-3 heads with {raw['num_hidden_layers']} layers are not supported (only 1)")
    layer = parse_config({**raw, "model_type": "llama", "num_hidden_layers": 1})
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise Eagle3Error("eagle_config.use_aux_hidden_state=false (an EAGLE-1/2 style head) is not an EAGLE-3 head")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        layer=layer,
        hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
        vocab_size=layer.vocab_size,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        fc_bias=bool(raw.get("bias", False)),
    )


class Eagle3Head(nn.Module):
    """The head of the module docstring; a `FeatureHead`-compatible module for `EagleDrafter` (its features are
    the fused g / pre-norm p states of width D)."""

    feature_space = "eagle3"

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        cfg = config.layer
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.midlayer = DecoderLayer(cfg, 0)
        attn = self.midlayer.self_attn
        attn.q_proj = nn.Linear(2 * D, H * hd, bias=cfg.qkv_bias)  # the attention reads [embedding ; feature]
        attn.k_proj = nn.Linear(2 * D, Hkv * hd, bias=cfg.qkv_bias)
        attn.v_proj = nn.Linear(2 * D, Hkv * hd, bias=cfg.qkv_bias)
        self.midlayer.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * config.hidden_size, D, bias=config.fc_bias)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(D, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [Vd]
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))  # [V]

    def fuse_target(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three auxiliary states [..., 3 Dt] -> g [..., D]."""
        return self.fc(aux)

    def _step(self, features: torch.Tensor, token_emb: torch.Tensor, attend) -> torch.Tensor:
        m = self.midlayer
        g = m.hidden_norm(features)
        residual = g if self.config.norm_before_residual else features
        residual = residual + attend(torch.cat([m.input_layernorm(token_emb.to(features.dtype)), g], dim=-1))
        return residual + m.mlp(m.post_attention_layernorm(residual))

    def forward(self, features: torch.Tensor, token_emb: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Causal forward without cache: features, token_emb [B, T, D] at positions start.. -> p [B, T, D]."""
        pos = torch.arange(start, start + features.shape[1], device=features.device)
        cos, sin = rope_table(self.config.layer, pos, features.dtype)
        return self._step(features, token_emb, lambda y: self.midlayer.self_attn.forward_plain(y, cos, sin))

    def forward_cached(
        self, features: torch.Tensor, token_emb: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache
    ) -> torch.Tensor:
        """Packed forward over the head's one-layer paged cache: features, token_emb [N, D] -> p [N, D]."""
        cos, sin = rope_table(self.config.layer, batch.positions, features.dtype)
        attn = self.midlayer.self_attn
        return self._step(features, token_emb, lambda y: attn.forward_cached(y, cos, sign_sin(sin), batch, kv, 0))

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def target_logits(self, out: torch.Tensor) -> torch.Tensor:
        """p [..., D] -> logits over the TARGET vocabulary [..., V] (-inf outside the draft vocabulary)."""
        draft = self.lm_head(self.norm(out))  # [..., Vd]
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., torch.arange(self.config.draft_vocab_size, device=draft.device) + self.d2t] = draft
        return full

    def new_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> PagedKVCache:
        cfg = dataclasses.replace(self.config.layer, num_layers=1)
        return PagedKVCache.for_model(cfg, num_blocks, block_size, dtype, device)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    binary = path / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise Eagle3Error(f"no *.safetensors or pytorch_model.bin in {path}")


def _normalise(key: str) -> str:
    key = key.removeprefix("model.")
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def load_eagle3_head(path: str | os.PathLike, target: Model) -> tuple[Eagle3Head, tuple[int, ...]]:
    """A head folder -> (head on the target's device / dtype, the target layers to capture). Every check (sizes,
    vocabulary maps, aux layers, every tensor accounted for) runs before any weight is placed."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    cfg = parse_eagle3_config(raw)
    tcfg = target.config
    if cfg.vocab_size != tcfg.vocab_size:
        raise Eagle3Error(f"{path}: the EAGLE-3 head's vocabulary ({cfg.vocab_size}) differs from the target's "
                          f"({tcfg.vocab_size})")  # fmt: skip
    if cfg.hidden_size != tcfg.hidden_size:
        raise Eagle3Error(f"{path}: the head reads target hidden states of size {cfg.hidden_size} "
                          f"(target_hidden_size / hidden_size), the target's are {tcfg.hidden_size}")  # fmt: skip
    capture = cfg.capture_layers(tcfg.num_layers)
    state = {_normalise(k): v for k, v in _read_weights(path).items()}
    width = cfg.layer.hidden_size
    shared = {"embed_tokens.weight": target.model.embed_tokens.weight}
    if "draft_vocab_size" not in raw:  # full vocabulary: SGLang takes the target's lm_head when the head has none
        shared["lm_head.weight"] = target.lm_head.weight
    for key, stand_in in shared.items():
        if key not in state:
            if width != tcfg.hidden_size:
                raise Eagle3Error(f"{path}: no {key} and the head width {width} differs from the target's "
                                  f"{tcfg.hidden_size}: it cannot share the target's")  # fmt: skip
            state[key] = stand_in.detach().cpu()
    if raw.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    state.setdefault("d2t", torch.zeros(Vd, dtype=torch.long))
    ids = torch.arange(Vd) + state["d2t"].long()
    if state["d2t"].shape != (Vd,) or int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
        raise Eagle3Error(f"{path}: d2t must map the {Vd} draft ids to distinct target ids in [0, {V})")
    t2d = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
        raise Eagle3Error(f"{path}: t2d does not mark exactly the target ids that d2t maps to")
    state["t2d"] = t2d
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    expected = head.state_dict()
    check_state(state, expected, path, "EAGLE-3 weights", Eagle3Error)
    head = head.to_empty(device=target.device)
    head.load_state_dict({k: v if k in ("d2t", "t2d") else v.to(target.dtype) for k, v in state.items()})
    return head.to(target.dtype).eval().requires_grad_(False), capture
