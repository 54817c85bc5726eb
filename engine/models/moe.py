"""MoE block: router -> softmax -> top-r -> grouped expert GEMM over active experts -> combine.

    x [T, D] --gate--> router_logits [T, E] --softmax(fp32)--> top-r (renormalise iff norm_topk_prob)
             --kernels.fused_moe--> permute by expert, SiLU-gated GEMM per active expert, weighted unpermute
             (+ sigmoid(shared_expert_gate(x)) * shared_expert(x) for qwen2_moe; ungated for deepseek_v3)

router="sigmoid" replaces softmax -> top-r with DeepSeek-V3's sigmoid, correction-biased, group-limited
choice (engine.models.routing; the bias is the buffer `gate.e_score_correction_bias`).

Shape letters: T=tokens D=hidden E=experts r=top-r F=expert dim.
Every call can append its routing to a `RoutingRecord` for the instrumentation (footprint, reuse,
rank loads). An expert budget B (MoE-Spec, 2602.16052; `Engine(expert_budget=B)`, verification forwards
of more than one token only) keeps the B experts with most router probability summed over the forward's
tokens and re-picks each token's top-r inside them. It is APPROXIMATE: a token whose own top-r leaves
the kept set is computed with other experts than the target would use, so outputs are no longer the
target's (B = E changes nothing); it caps the distinct experts per layer at B.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.models.layout import preferred_layout
from engine.models.routing import budget_applies, budget_dropped, sigmoid_group_topk
from engine.timing import PhaseTimer, maybe_phase
from kernels import cpu_decode
from kernels.small_m import linear

# hidden [T, D], w_gate_up [E, 2F, D], w_down [E, D, F], expert_ids [T, r], topk_weights [T, r] -> [T, D]
ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RoutingRecord:
    """Routing of one forward pass, one entry per MoE layer (in layer order)."""

    layers: list[int] = field(default_factory=list)
    expert_ids: list[torch.Tensor] = field(default_factory=list)  # each [T, r] int64
    topk_weights: list[torch.Tensor] = field(default_factory=list)  # each [T, r] float32
    router_logits: list[torch.Tensor] = field(default_factory=list)  # each [T, E]; only if keep_logits
    keep_logits: bool = False


def fused_weight(owner: nn.Module, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) cached on `owner` for inference matmuls; rebuilt whenever any part changes
    (storage, in-place version counter, device or dtype), so weight updates are never missed. On CPU the fused
    matrix takes the layout its gemv reads fastest (`engine.models.layout.preferred_layout`)."""
    key = tuple((p.data_ptr(), p._version, p.device, p.dtype) for p in parts)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = owner.__dict__[name] = (key, preferred_layout(torch.cat(parts).detach()))
    return cached[1]


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.gate_proj.bias is not None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # inference: gate and up projections in one matmul
        h = linear(x, fused_weight(self, "_gate_up", [self.gate_proj.weight, self.up_proj.weight]), pack=True)
        inter = self.gate_proj.weight.shape[0]
        # the down projection through the small-M kernel too (BLAS forks threads that stall when the other core is busy)
        return linear(F.silu(h[..., :inter]) * h[..., inter:], self.down_proj.weight, pack=True)


class Experts(nn.Module):
    """Stacked expert weights, the layout of HF transformers 5 and of `kernels.fused_moe`."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # [E, 2F, D]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))  # [E, D, F]


class MoEBlock(nn.Module):
    """Sparse MoE layer with optional shared expert (qwen2_moe)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_r: int,
        moe_inter: int,
        norm_topk_prob: bool,
        shared_inter: int = 0,
        router: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_gated: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_r, self.norm_topk_prob = num_experts, top_r, norm_topk_prob
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {router!r}")
        self.router, self.n_group, self.topk_group = router, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        if router == "sigmoid":
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts))  # [E]
        self.experts = Experts(num_experts, hidden, moe_inter)
        self.shared_expert = DenseMLP(hidden, shared_inter) if shared_inter > 0 else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_inter > 0 and shared_gated else None
        self.backend = "auto"  # "auto" | "torch" | "triton"
        self.expert_fn: ExpertFn | None = None  # set by expert parallelism / offload to replace local compute

    def local_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This block's expert math over given weights, the `ExpertFn` it runs without an `expert_fn` and the
        compute EP and offload run on the experts they hold: x [T, D], w_gate_up [E', 2F, D], w_down [E', D, F],
        expert_ids [T, r] rows of the weights (-1 = contributes 0) -> [T, D]. rows [E']: the expert id of each
        weight row, for per-expert parameters beyond the two weights (gpt_oss's biases); None: the block's own
        storage order (after EP's sharding, its own experts)."""
        return expert_compute(x, w_gate_up, w_down, expert_ids, topk_weights, backend=self.backend)

    def _fused_input(self) -> torch.Tensor:
        """[E + 2Fs + 1, D]: router, shared gate/up and shared-expert gate rows for one matmul."""
        parts = [self.gate.weight]
        if self.shared_expert is not None:
            se = self.shared_expert
            parts += [se.gate_proj.weight, se.up_proj.weight]
            if self.shared_expert_gate is not None:
                parts.append(self.shared_expert_gate.weight)
        return fused_weight(self, "_fused", parts)

    def route(
        self, x: torch.Tensor, router_logits: torch.Tensor | None = None, expert_budget: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> router_logits [T, E], topk_weights [T, r] (x.dtype), expert_ids [T, r] int64.

        expert_budget B (approximate, MoE-Spec 2602.16052; applied when T > 1 and r <= B < E): only the B
        experts of largest router probability summed over the T tokens may be picked."""
        if router_logits is None:
            router_logits = self.gate(x)
        if self.router == "sigmoid":
            budget = expert_budget if x.shape[0] > 1 else None
            topk_weights, expert_ids = sigmoid_group_topk(
                router_logits, self.gate.e_score_correction_bias, self.top_r, self.n_group, self.topk_group,
                self.norm_topk_prob, self.routed_scaling_factor, budget,
            )  # fmt: skip
            return router_logits, topk_weights.to(x.dtype), expert_ids
        exact = not budget_applies(x.shape[0], self.num_experts, expert_budget, self.top_r)
        if exact and router_logits.stride(-1) == 1 and cpu_decode.applies(router_logits):  # the ops below, one C++ call
            topk_weights, expert_ids = cpu_decode.route_softmax(router_logits, self.top_r, self.norm_topk_prob)
            return router_logits, topk_weights, expert_ids
        router_probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
        dropped = budget_dropped(router_probs, expert_budget, self.top_r)
        if dropped is not None:
            router_probs = router_probs.masked_fill(dropped, -1.0)  # every kept prob (>= 0) outranks a dropped one
        topk_weights, expert_ids = torch.topk(router_probs, self.top_r, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return router_logits, topk_weights.to(x.dtype), expert_ids

    def forward(
        self,
        x: torch.Tensor,
        record: RoutingRecord | None = None,
        layer: int = -1,
        timer: PhaseTimer | None = None,
        expert_budget: int | None = None,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (out [T, D], router_logits [T, E]). expert_budget: see `route` (approximate). fused: allow the
        fused CPU call (`_fused_cpu`); the engine's cached forward asks for it, the plain forward keeps the torch path
        (the reference that offload and EP reproduce bit for bit)."""
        shared_in = None
        with maybe_phase(timer, "router"):
            if torch.is_grad_enabled():
                router_logits, topk_weights, expert_ids = self.route(x, None, expert_budget)
            else:  # inference: router and shared-expert input projections in one matmul
                proj = linear(x, self._fused_input(), pack=True)
                E = self.num_experts
                router_logits, shared_in = proj[:, :E], proj[:, E:]
                router_logits, topk_weights, expert_ids = self.route(x, router_logits, expert_budget)
        if fused and self._fused_cpu(x, shared_in):  # <= 32 CPU tokens: experts, shared expert and their sum, one call
            with maybe_phase(timer, "experts"):
                se = self.shared_expert
                shared = (shared_in, se.down_proj.weight) if se is not None else (None, None)
                gated = self.shared_expert_gate is not None
                out = cpu_decode.moe_decode(x, self.experts.gate_up_proj, self.experts.down_proj, expert_ids,
                                            topk_weights, *shared, gated, pack=True)  # fmt: skip
            with maybe_phase(timer, "combine"):  # fused into "experts" above: an empty phase, kept for the profile
                pass
            return self._record(record, layer, expert_ids, topk_weights, router_logits, out)
        with maybe_phase(timer, "experts"):
            fn = self.expert_fn or self.local_experts
            out = fn(x, self.experts.gate_up_proj, self.experts.down_proj, expert_ids, topk_weights)
        with maybe_phase(timer, "combine"):
            if self.shared_expert is not None and shared_in is not None:
                Fs = self.shared_expert.gate_proj.weight.shape[0]
                act = F.silu(shared_in[:, :Fs]) * shared_in[:, Fs : 2 * Fs]
                shared = F.linear(act, self.shared_expert.down_proj.weight)
                if self.shared_expert_gate is not None:
                    shared = torch.sigmoid(shared_in[:, 2 * Fs :]) * shared
                out = out + shared
            elif self.shared_expert is not None:
                gate = 1.0 if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x))
                out = out + gate * self.shared_expert(x)
        return self._record(record, layer, expert_ids, topk_weights, router_logits, out)

    def _fused_cpu(self, x: torch.Tensor, shared_in: torch.Tensor | None) -> bool:
        """Whether these tokens take `kernels.cpu_decode.moe_decode`: 1 to cpu_decode.MAX_MOE_TOKENS CPU fp32 tokens
        at inference (fused input projection computed), the block's own local experts (no EP / offload `expert_fn`),
        no Triton backend."""
        return (
            1 <= x.shape[0] <= cpu_decode.MAX_MOE_TOKENS
            and self.expert_fn is None
            and self.backend != "triton"
            and (self.shared_expert is None or shared_in is not None)
            and cpu_decode.applies(x)
            and not torch.is_grad_enabled()
        )

    @staticmethod
    def _record(record, layer, expert_ids, topk_weights, router_logits, out):
        """Append this layer's routing to `record` (if any) -> (out, router_logits)."""
        if record is not None:
            record.layers.append(layer)
            record.expert_ids.append(expert_ids.detach())
            record.topk_weights.append(topk_weights.detach().float())
            if record.keep_logits:
                record.router_logits.append(router_logits.detach())
        return out, router_logits


def check_expert_budget(expert_budget: int | None, num_experts: int, top_r: int) -> int | None:
    """Validate an `Engine(expert_budget=B)`: None (exact) or an int with top_r <= B <= num_experts."""
    if expert_budget is None:
        return None
    if num_experts == 0:
        raise ValueError("expert_budget needs an MoE target (this one has no routed experts)")
    if (
        isinstance(expert_budget, bool)
        or not isinstance(expert_budget, int)
        or not top_r <= expert_budget <= num_experts
    ):
        raise ValueError(
            f"expert_budget must be None or an int in [top_r, num_experts] = [{top_r}, {num_experts}], "
            f"got {expert_budget!r}"
        )
    return expert_budget


def expert_compute(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Local expert compute, the `ExpertFn` a block runs without an `expert_fn` (offload reuses it over its
    device buffer): x [T, D], w_gate_up [E, 2F, D], w_down [E, D, F], expert_ids [T, r] (-1 = contributes 0)
    -> [T, D]. One CPU decode token takes `_single_token_experts`; everything else `kernels.fused_moe`."""
    if x.shape[0] == 1 and backend != "triton" and not x.is_cuda and not torch.is_grad_enabled():
        return _single_token_experts(x, w_gate_up, w_down, expert_ids, topk_weights)
    return kernels.fused_moe(x, w_gate_up, w_down, expert_ids, topk_weights, backend=backend)


def _single_token_experts(
    x: torch.Tensor, gu: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Decode fast path on CPU (T = 1): the same math as `kernels.fused_moe_ref` without the
    permutation bookkeeping, which dominates at one token. x [1, D] -> [1, D]."""
    F_ = down.shape[-1]
    out = torch.zeros_like(x)
    for e, w in zip(expert_ids[0].tolist(), topk_weights[0].tolist()):
        if e < 0:
            continue
        h = linear(x, gu[e])  # [1, 2F], the expert's weights read in place
        out.addmm_(F.silu(h[:, :F_]) * h[:, F_:], down[e].t(), alpha=w)  # out += w * down(act), one op
    return out


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_r: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss (2101.03961) E * sum_e f_e * P_e, averaged over layers.

    router_logits: one [T, E] per MoE layer. f_e = share of top-r assignments to e, P_e = mean router prob.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        top = probs.topk(top_r, dim=-1).indices  # [T, r]
        frac = F.one_hot(top, num_experts).float().sum(1).mean(0) / top_r  # [E]
        losses.append(num_experts * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()
