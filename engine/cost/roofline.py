"""Cost models of one target forward: a roofline from hardware + model spec, and a least-squares fit.

    from engine.cost.roofline import RooflineCost, load_hardware, load_model_spec
    roofline = RooflineCost(load_hardware("h100"), load_model_spec("qwen3_30b_a3b"))
    breakdown = roofline.forward_cost(routing, context_len=512)    # routing: L x LongTensor [n, r]
    t_ar = roofline.decode_cost(context_len=512).total              # T_AR: one target-only token

Roofline (Williams, Waterman & Patterson, CACM 2009; DESIGN §2 "Cost models"): every phase costs
max(bytes / HBM bandwidth, flops / peak), so a decode-sized forward is priced by the weights it reads.
Per transformer layer:

    attention  = max((attention weights + KV of context + new tokens) / HBM, projection + score flops / peak)
                 MLA (kv_lora_rank > 0, DeepSeek-V3): the latent cache (kv_lora_rank + qk_rope_head_dim per
                 token) and the cheaper of the absorbed form (2H(2r + dr) flops per query-key pair, W_UK / W_UV
                 applied per query) and the expanded one (kv_b_proj decompresses every context latent, then
                 2H(dn + dr + dv) per pair): decode and verification take the absorbed form
    router     = max(router weights / HBM, 2 n D E / peak)
    expert     = sum over ACTIVE experts e of max(3 D F bytes / HBM, 6 D F t_e / peak)   (+ shared experts)
    dispatch   = combine = remote (token, rank) pairs x D x activation bytes / link bandwidth + link latency
    layer time = attention + router + slowest EP rank's expert time + dispatch + combine + launches

Dispatch counts each token once per remote rank it needs (as DeepEP-style all-to-alls do) and prices
the busiest rank's send or receive. Hardware profiles live in conf/hardware/*.yaml, model specs in
conf/model_spec/*.yaml; both are plain data. `fit_cost_model` fits four interpretable constants to
measured (routing, seconds) samples instead.
"""

# n=verified tokens r=top-r L=MoE layers E=experts D=hidden F=expert dim W=EP ranks
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.cost.utility import expected_distinct_experts
from engine.parallel.placement import ExpertPlacement, assign_ranks
from engine.paths import CONF_DIR

LAUNCHES_PER_LAYER = 12  # norms, qkv, rope, attention, o-proj, router, top-r, permute, 2 GEMMs, combine, add
LAUNCHES_PER_FORWARD = 4  # embedding, final norm, lm_head, sampling
PHASES = ("attention", "router", "expert_gemm", "dispatch", "combine", "other")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator. Bandwidths in bytes/s per direction, latencies and overheads in seconds.

    `nvlink_bandwidth` / `nvlink_latency` are None where the GPUs have no NVLink; intra-node traffic then
    goes over PCIe.
    """

    name: str
    hbm_bandwidth: float
    peak_flops_bf16: float
    peak_flops_fp8: float
    nvlink_bandwidth: float | None
    nvlink_latency: float | None
    internode_bandwidth: float
    internode_latency: float
    pcie_bandwidth: float
    pcie_latency: float
    launch_overhead: float
    gpus_per_node: int = 8
    notes: str = ""

    def intra_node_link(self) -> tuple[float, float]:
        """(bandwidth, latency) between two GPUs of one node."""
        if self.nvlink_bandwidth:
            return self.nvlink_bandwidth, self.nvlink_latency or 0.0
        return self.pcie_bandwidth, self.pcie_latency


@dataclass(frozen=True)
class ModelSpec:
    """Shape of an MoE target, enough to price a forward. Dense layers come first (DeepSeek-V3: 3).

    `kv_bytes_per_token` (per layer) and `attention_params` (per layer) default to standard GQA values, or to
    MLA's when `kv_lora_rank` > 0 (then `q_lora_rank` (0 = full-rank q), `qk_nope_head_dim`,
    `qk_rope_head_dim` and `v_head_dim` describe the attention; `head_dim` is unused). `compute_dtype` picks
    the peak (bf16 or fp8).
    """

    name: str
    num_layers: int
    num_dense_layers: int
    hidden_size: int
    expert_dim: int
    num_experts: int
    top_r: int
    num_shared_experts: int
    shared_expert_dim: int
    dense_ffn_dim: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    expert_weight_bytes: float
    dense_weight_bytes: float
    activation_bytes: float = 2.0
    compute_dtype: str = "bf16"
    kv_bytes_per_token: float | None = None
    attention_params: int | None = None
    weight_format: str = "bf16"
    notes: str = ""
    kv_lora_rank: int = 0  # > 0: multi-head latent attention
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.compute_dtype not in ("bf16", "fp8"):
            raise ValueError(f"compute_dtype must be 'bf16' or 'fp8', got {self.compute_dtype!r}")
        if not 0 <= self.num_dense_layers <= self.num_layers or not 0 < self.top_r <= self.num_experts:
            raise ValueError(f"{self.name}: need 0 <= num_dense_layers <= num_layers and 0 < top_r <= num_experts")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.expert_dim * self.expert_weight_bytes

    @property
    def kv_bytes(self) -> float:
        """KV-cache bytes per token per layer."""
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        if self.kv_lora_rank:  # the compressed latent and the shared rope key (engine.models.mla)
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.activation_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.activation_bytes

    @property
    def attn_params(self) -> int:
        """Attention projection parameters per layer (q, k, v, o)."""
        if self.attention_params is not None:
            return self.attention_params
        if self.kv_lora_rank:
            return self._mla_q_params + self._mla_kv_a_params + self._mla_kv_b_params + self._mla_o_params
        q_o = 2 * self.hidden_size * self.num_attention_heads * self.head_dim
        return q_o + 2 * self.hidden_size * self.num_kv_heads * self.head_dim

    # MLA projections: q (q_a + q_b, or q_proj), kv_a_proj_with_mqa, kv_b_proj (W_UK ; W_UV), o_proj
    @property
    def _mla_q_params(self) -> int:
        H, D, qk = self.num_attention_heads, self.hidden_size, self.qk_nope_head_dim + self.qk_rope_head_dim
        return D * self.q_lora_rank + self.q_lora_rank * H * qk if self.q_lora_rank else D * H * qk

    @property
    def _mla_kv_a_params(self) -> int:
        return self.hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def _mla_kv_b_params(self) -> int:
        return self.kv_lora_rank * self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def _mla_o_params(self) -> int:
        return self.num_attention_heads * self.v_head_dim * self.hidden_size

    def attention_flops(self, n: int, context_len: int) -> float:
        """Flops of one layer's attention over n new tokens after context_len cached ones (projections
        and scores). MLA: the cheaper of the absorbed and the expanded form (see the module docstring)."""
        S, H = context_len + n, self.num_attention_heads
        if not self.kv_lora_rank:
            return 2.0 * n * self.attn_params + 4.0 * H * self.head_dim * n * S
        r, dn, dr, dv = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        absorbed = 2.0 * n * self.attn_params + 2.0 * H * (2 * r + dr) * n * S
        expanded = 2.0 * n * (self.attn_params - self._mla_kv_b_params) + 2.0 * S * self._mla_kv_b_params
        return min(absorbed, expanded + 2.0 * H * (dn + dr + dv) * n * S)


def _load_yaml_dataclass(cls: type, group: str, name_or_path: str | Path) -> Any:
    """Read conf/<group>/<name>.yaml (or a path) into `cls` through OmegaConf's structured configs: a missing,
    unknown or mistyped field is a ValueError naming the file, the field and `cls`."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = CONF_DIR / group / f"{name_or_path}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"unknown {group} {str(name_or_path)!r}; available: {', '.join(available)}")
    try:
        values = OmegaConf.load(path)  # OmegaConf's YAML reads 3.35e12 as a float (PyYAML would say str)
        if not isinstance(values, DictConfig):
            raise ValueError(f"{path}: expected a mapping of {cls.__name__} fields, got a list")
        values.setdefault("name", path.stem)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except OmegaConfBaseException as err:  # missing / unknown / mistyped field: OmegaConf names it
        raise ValueError(f"{path}: {err}") from err


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """A profile from conf/hardware/<name>.yaml or a YAML path; ValueError names missing fields."""
    return _load_yaml_dataclass(HardwareProfile, "hardware", name_or_path)


def load_model_spec(name_or_path: str | Path) -> ModelSpec:
    """A spec from conf/model_spec/<name>.yaml or a YAML path; ValueError names missing fields."""
    return _load_yaml_dataclass(ModelSpec, "model_spec", name_or_path)


def model_spec_from_hf_config(config: Mapping[str, Any], name: str = "hf", weight_bytes: float = 2.0) -> ModelSpec:
    """ModelSpec of a Hugging Face MoE `config.json` (qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3, glm4_moe,
    gpt_oss)."""
    heads = config["num_attention_heads"]
    shared_dim = int(config.get("shared_expert_intermediate_size") or 0)
    num_shared = 1 if shared_dim else 0
    num_dense = len(config.get("mlp_only_layers") or [])
    mla: dict[str, int] = {}
    if config.get("n_routed_experts"):  # DeepSeek-V3-style: n_shared_experts of the routed size, dense first layers
        num_shared = int(config.get("n_shared_experts", 1) or 0)
        shared_dim = int(config["moe_intermediate_size"]) if num_shared else 0
        num_dense = min(int(config.get("first_k_dense_replace", 0) or 0), config["num_hidden_layers"])
    if config.get("kv_lora_rank"):
        mla = {k: int(config.get(k) or 0) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                     "qk_rope_head_dim", "v_head_dim")}  # fmt: skip
    return ModelSpec(
        name=name,
        num_layers=config["num_hidden_layers"],
        num_dense_layers=num_dense,
        hidden_size=config["hidden_size"],
        expert_dim=config.get("moe_intermediate_size") or config["intermediate_size"],
        num_experts=config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"],
        top_r=config["num_experts_per_tok"],
        num_shared_experts=num_shared,
        shared_expert_dim=shared_dim,
        dense_ffn_dim=config.get("intermediate_size", 0),
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        expert_weight_bytes=weight_bytes,
        dense_weight_bytes=weight_bytes,
        activation_bytes=weight_bytes,
        **mla,
    )


@dataclass(frozen=True)
class CostBreakdown:
    """Seconds per phase of one target forward; `per_layer` holds each transformer layer's total."""

    attention: float = 0.0
    router: float = 0.0
    expert_gemm: float = 0.0
    dispatch: float = 0.0
    combine: float = 0.0
    other: float = 0.0  # dense-layer FFNs, lm_head, kernel launches
    per_layer: tuple[float, ...] = ()

    @property
    def total(self) -> float:
        return self.attention + self.router + self.expert_gemm + self.dispatch + self.combine + self.other

    def as_dict(self) -> dict[str, float]:
        return {**{p: getattr(self, p) for p in PHASES}, "total": self.total}


class RooflineCost:
    """Prices a target forward from its routing on one hardware profile, optionally under an EP layout.

    `layout` is one ExpertPlacement for every MoE layer or a sequence with one per MoE layer. Tokens live
    on `token_rank` (default: all on rank 0, one request); attention is priced on that rank and is not
    split by EP. Calling the object returns total seconds (the engine's `cost_model` callable).
    """

    def __init__(
        self,
        hw: HardwareProfile,
        spec: ModelSpec,
        layout: ExpertPlacement | Sequence[ExpertPlacement] | None = None,
    ) -> None:
        self.hw, self.spec = hw, spec
        self.peak = hw.peak_flops_fp8 if spec.compute_dtype == "fp8" else hw.peak_flops_bf16
        if isinstance(layout, ExpertPlacement):
            layout = [layout] * spec.num_moe_layers
        if layout is not None:
            layout = list(layout)
            if len(layout) != spec.num_moe_layers:
                raise ValueError(f"layout has {len(layout)} placements for {spec.num_moe_layers} MoE layers")
            for p in layout:
                if p.num_experts != spec.num_experts:
                    raise ValueError(f"placement has {p.num_experts} experts, spec {spec.num_experts}")
        self.layout: list[ExpertPlacement] | None = layout

    def __call__(self, routing: Sequence[torch.Tensor], context_len: int) -> float:
        return self.forward_cost(routing, context_len).total

    # ------------------------------------------------------------------ primitives
    def _roof(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.hw.hbm_bandwidth, flops / self.peak)

    def _experts_time(self, tokens_per_expert: torch.Tensor, count: float = 1.0) -> float:
        """Σ over active experts of max(weight bytes / HBM, flops / peak); zero-token experts are free."""
        t = tokens_per_expert[tokens_per_expert > 0].double()
        flops = 6.0 * self.spec.hidden_size * self.spec.expert_dim * t
        mem = torch.full_like(t, self.spec.expert_bytes / self.hw.hbm_bandwidth)
        return count * float(torch.maximum(mem, flops / self.peak).sum())

    def _shared_time(self, n: float) -> float:
        s = self.spec
        if n <= 0 or s.num_shared_experts == 0:
            return 0.0
        params = 3 * s.hidden_size * s.shared_expert_dim * s.num_shared_experts
        return self._roof(params * s.dense_weight_bytes, 2.0 * n * params)

    def _attention_time(self, n: int, context_len: int) -> float:
        s = self.spec
        nbytes = s.attn_params * s.dense_weight_bytes + (context_len + n) * s.kv_bytes
        return self._roof(nbytes, s.attention_flops(n, context_len))

    def _router_time(self, n: int) -> float:
        s = self.spec
        return self._roof(s.hidden_size * s.num_experts * s.dense_weight_bytes, 2.0 * n * s.hidden_size * s.num_experts)

    def _dense_ffn_time(self, n: int) -> float:
        s = self.spec
        params = 3 * s.hidden_size * s.dense_ffn_dim
        return self._roof(params * s.dense_weight_bytes, 2.0 * n * params)

    def _lm_head_time(self, n: int) -> float:
        s = self.spec
        return self._roof(s.vocab_size * s.hidden_size * s.dense_weight_bytes, 2.0 * n * s.vocab_size * s.hidden_size)

    def _dispatch_time(self, token_rank: torch.Tensor, serving: torch.Tensor, placement: ExpertPlacement) -> float:
        """One all-to-all: each token goes once to every remote rank serving one of its experts."""
        W, rpn = placement.world_size, placement.ranks_per_node
        src = token_rank[:, None].expand_as(serving)  # [n, r]
        token = torch.arange(len(serving))[:, None].expand_as(serving)  # [n, r]
        rows = torch.stack([token, src, serving], -1).reshape(-1, 3)  # (token, src rank, dst rank)
        pairs = torch.unique(rows, dim=0)  # a token is sent once to each rank, however many experts it uses
        pairs = pairs[pairs[:, 1] != pairs[:, 2]]
        if len(pairs) == 0:
            return 0.0
        msg = self.spec.hidden_size * self.spec.activation_bytes
        inter = (pairs[:, 1] // rpn) != (pairs[:, 2] // rpn)
        intra_bw, intra_lat = self.hw.intra_node_link()
        worst = 0.0
        for cls_mask, bw in ((~inter, intra_bw), (inter, self.hw.internode_bandwidth)):
            sel = pairs[cls_mask]
            if len(sel):
                out_b = torch.bincount(sel[:, 1], minlength=W).max().item() * msg
                in_b = torch.bincount(sel[:, 2], minlength=W).max().item() * msg
                worst = max(worst, max(out_b, in_b) / bw)
        latency = self.hw.internode_latency if bool(inter.any()) else intra_lat
        return worst + latency

    # ------------------------------------------------------------------ public
    def forward_cost(
        self, routing: Sequence[torch.Tensor], context_len: int, token_rank: torch.Tensor | None = None
    ) -> CostBreakdown:
        """Cost of one forward over n verified tokens. routing: one LongTensor [n, r] per MoE layer."""
        s = self.spec
        if len(routing) != s.num_moe_layers:
            raise ValueError(f"routing has {len(routing)} layers, spec {s.name} has {s.num_moe_layers} MoE layers")
        n = int(routing[0].shape[0]) if len(routing) else 0
        if token_rank is None:
            token_rank = torch.zeros(n, dtype=torch.long)
        parts = dict.fromkeys(PHASES, 0.0)
        per_layer = []
        launch = LAUNCHES_PER_LAYER * self.hw.launch_overhead
        attn = self._attention_time(n, context_len)
        dense_ffn = self._dense_ffn_time(n)
        for _ in range(s.num_dense_layers):
            parts["attention"] += attn
            parts["other"] += dense_ffn + launch
            per_layer.append(attn + dense_ffn + launch)
        for layer, expert_ids in enumerate(routing):
            if expert_ids.shape[0] != n:
                raise ValueError(f"MoE layer {layer} routes {expert_ids.shape[0]} tokens, layer 0 routes {n}")
            if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= s.num_experts):
                raise ValueError(f"MoE layer {layer} has expert ids outside [0, {s.num_experts})")
            router = self._router_time(n)
            ids = expert_ids.reshape(-1).long()
            if self.layout is None:
                counts = torch.bincount(ids, minlength=s.num_experts)  # [E] tokens per expert
                expert = self._experts_time(counts) + self._shared_time(n)
                dispatch = 0.0
            else:
                placement = self.layout[layer]
                serving = assign_ranks(expert_ids, placement, token_rank).reshape(-1)  # [n*r]
                tokens_on = torch.bincount(token_rank, minlength=placement.world_size)
                expert = max(
                    self._experts_time(torch.bincount(ids[serving == w], minlength=s.num_experts))
                    + self._shared_time(float(tokens_on[w]))
                    for w in range(placement.world_size)
                )
                dispatch = self._dispatch_time(token_rank, serving.reshape(expert_ids.shape), placement)
            parts["attention"] += attn
            parts["router"] += router
            parts["expert_gemm"] += expert
            parts["dispatch"] += dispatch
            parts["combine"] += dispatch  # the reverse all-to-all moves the same bytes
            parts["other"] += launch
            per_layer.append(attn + router + expert + 2 * dispatch + launch)
        parts["other"] += self._lm_head_time(n) + LAUNCHES_PER_FORWARD * self.hw.launch_overhead
        return CostBreakdown(**parts, per_layer=tuple(per_layer))

    def counts_cost(self, tokens_per_expert: torch.Tensor | None, num_tokens: int, context_len: int) -> float:
        """Total seconds of a forward over `num_tokens` without an EP layout, from its expert token counts
        [L, E] (RoundStats.tokens_per_expert; None: uniform routing, as `expected_cost`). Equals
        `forward_cost(routing, context_len).total` for a routing with these counts, in scalar arithmetic (a
        few µs: cheap enough to price every served round)."""
        if self.layout is not None:
            raise ValueError("counts_cost prices a forward without an EP layout; use forward_cost(routing, ...)")
        s, n = self.spec, num_tokens
        if tokens_per_expert is None:
            active = expected_distinct_experts(s.num_experts, s.top_r, n)
            experts = s.num_moe_layers * self._expected_experts_time(n, active)
        else:
            if tuple(tokens_per_expert.shape) != (s.num_moe_layers, s.num_experts):
                raise ValueError(f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)}, spec {s.name} needs "
                                 f"[{s.num_moe_layers}, {s.num_experts}]")  # fmt: skip
            experts = self._experts_time(tokens_per_expert.reshape(-1))
        launch = LAUNCHES_PER_LAYER * self.hw.launch_overhead
        attn = self._attention_time(n, context_len)
        dense = s.num_dense_layers * (attn + self._dense_ffn_time(n) + launch)
        moe = s.num_moe_layers * (attn + self._router_time(n) + self._shared_time(n) + launch)
        return dense + moe + experts + self._lm_head_time(n) + LAUNCHES_PER_FORWARD * self.hw.launch_overhead

    def _expected_experts_time(self, n: int, active: float) -> float:
        """One MoE layer's routed experts under uniform routing: `active` experts with n·r/active tokens each."""
        if active <= 0:
            return 0.0
        s = self.spec
        return active * self._roof(s.expert_bytes, 6.0 * s.hidden_size * s.expert_dim * (n * s.top_r / active))

    def decode_cost(self, context_len: int, routing: Sequence[torch.Tensor] | None = None) -> CostBreakdown:
        """T_AR: one target-only token. Without routing, the expectation under uniform routing."""
        if routing is None:
            return self.expected_cost(1, context_len)
        return self.forward_cost(routing, context_len)

    def expected_cost(self, num_tokens: int, context_len: int, num_samples: int = 16, seed: int = 0) -> CostBreakdown:
        """Cost of n tokens under uniform independent routing.

        Without EP: closed form, U = M·[1 − (1 − r/M)^n] active experts holding n·r/U tokens each.
        With EP: mean over `num_samples` uniform routings drawn from a fixed seed (rank maxima have no
        simple closed form).
        """
        s = self.spec
        if self.layout is not None:
            gen = torch.Generator().manual_seed(seed)
            costs = []
            for _ in range(num_samples):
                routing = [
                    torch.rand(num_tokens, s.num_experts, generator=gen).topk(s.top_r, -1).indices
                    for _ in range(s.num_moe_layers)
                ]
                costs.append(self.forward_cost(routing, context_len))
            mean = {k: sum(getattr(c, k) for c in costs) / num_samples for k in PHASES}
            per_layer = tuple(float(np.mean([c.per_layer[i] for c in costs])) for i in range(s.num_layers))
            return CostBreakdown(**mean, per_layer=per_layer)
        base = self.forward_cost([torch.zeros(num_tokens, 0, dtype=torch.long)] * s.num_moe_layers, context_len)
        active = expected_distinct_experts(s.num_experts, s.top_r, num_tokens)
        expert = self._expected_experts_time(num_tokens, active)  # shared experts are already in `base`
        per_layer = tuple(t + (expert if i >= s.num_dense_layers else 0.0) for i, t in enumerate(base.per_layer))
        return dataclasses.replace(base, expert_gemm=base.expert_gemm + s.num_moe_layers * expert, per_layer=per_layer)
