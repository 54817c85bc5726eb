"""Expert predictor: drafter feature [D] -> per-MoE-layer expert logits [L, E] (DESIGN §2, Draft tree).

Trained (engine/train_heads.py) on recorded target routing: `Model.forward_batch(..., record_routing=True)`
gives, for each token, the top-r experts every MoE layer routes it to. At draft time it predicts for
every tree node the top-r experts per layer the target will route the node's token to, as
`DraftTree.predicted_experts [N, L, E] bool`; `select_expert_aware` (EcoSpec 2607.12696) then charges
each node its marginal expert cost ΔC against the (layer, expert) pairs already needed.

    features [N, D] -> RMSNorm -> Linear(D, H) -> SiLU -> Linear(H, L*E) -> logits [N, L, E] -> top-r per layer

Which feature: the one a drafter holds for a node at draft time, with the same meaning as in training.
For `EagleDrafter`: the head's output at the node (its predicted target feature of the node's
position); for a dense `ModelDrafter`: its final hidden state at the node. `config.input` records the
feature space; a predictor only serves the drafter it was trained on.

Drafter hook (any drafter with per-node features):

    annotate_tree(tree, node_features, predictor)     # fills tree.predicted_experts [N, L, E]
    tree = select_verified(tree, spec, drafted)       # λ > 0: expert-aware, else max_verify by path prob

Shape letters: N=tokens or tree nodes D=feature width H=hidden L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from engine.models.checkpoint import save_module_folder
from engine.models.transformer import RMSNorm

MODEL_TYPE = "expertspec_expert_predictor"


@dataclass(frozen=True)
class ExpertPredictorConfig:
    in_features: int  # D
    hidden_size: int  # H
    num_experts: int  # E
    top_r: int  # r
    moe_layers: tuple[int, ...]  # target layer index of each of the L predicted layers
    input: str = "eagle"  # feature space it was trained on: "eagle" | "mtp" | "target" | "dense"

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)


class ExpertPredictor(nn.Module):
    """A two-layer MLP from a feature to per-layer expert logits (see the module docstring)."""

    def __init__(self, cfg: ExpertPredictorConfig) -> None:
        super().__init__()
        self.config = cfg
        self.norm = RMSNorm(cfg.in_features, 1e-6)
        self.up = nn.Linear(cfg.in_features, cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.num_moe_layers * cfg.num_experts)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, D] -> expert logits [N, L, E]."""
        cfg = self.config
        h = F.silu(self.up(self.norm(features.to(self.up.weight.dtype))))
        return self.out(h).view(*features.shape[:-1], cfg.num_moe_layers, cfg.num_experts)

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, D] -> predicted top-r sets bool [N, L, E] (exactly r per node and layer)."""
        return topr_mask(self(features), self.config.top_r)


def topr_mask(logits: torch.Tensor, r: int) -> torch.Tensor:
    """logits [..., E] -> bool [..., E] with the r largest set (ties: lower index)."""
    idx = torch.topk(logits.float(), r, dim=-1).indices  # [..., r]
    return torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(-1, idx, True)


def routing_loss(logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [N, L, E] against the uniform law on the routed set expert_ids [N, L, r]."""
    target = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    target.scatter_(-1, expert_ids.long(), 1.0 / expert_ids.shape[-1])  # [N, L, E]
    return -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def topr_recall(logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Per-layer recall [L]: mean over tokens of |predicted top-r ∩ routed| / r.

    logits [N, L, E]; expert_ids [N, L, r] (the target's routing). Random guessing scores r / E."""
    r = expert_ids.shape[-1]
    pred = topr_mask(logits, r)  # [N, L, E]
    hit = pred.gather(-1, expert_ids.long())  # [N, L, r]
    return hit.float().sum(-1).mean(0) / r


def popularity_recall(train_ids: torch.Tensor, heldout_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-layer recall [L] of always predicting each layer's r most frequent training experts.

    train_ids, heldout_ids [N, L, r]: the baseline a predictor must beat besides r / E."""
    L = train_ids.shape[1]
    counts = torch.stack([torch.bincount(train_ids[:, l].reshape(-1).long(), minlength=num_experts)
                          for l in range(L)]).float()  # fmt: skip  # [L, E]
    return topr_recall(counts.expand(heldout_ids.shape[0], L, num_experts), heldout_ids)


# ---------------------------------------------------------------------------------------------- drafter hook


# ---------------------------------------------------------------------------------------------- save / load
def save_expert_predictor(
    predictor: ExpertPredictor, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None
) -> Path:
    """HF-like folder: config.json (`model_type: expertspec_expert_predictor`) + model.safetensors."""
    config = {"model_type": MODEL_TYPE, **asdict(predictor.config), "torch_dtype": str(dtype).removeprefix("torch.")}
    config["moe_layers"] = list(predictor.config.moe_layers)
    return save_module_folder(path, {**config, **(extra or {})}, predictor, dtype)


def load_expert_predictor(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> ExpertPredictor:
    """`zoo/expert-predictor` -> ExpertPredictor (eval mode, no grad)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    raw = json.loads(file.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{path} holds a {raw.get('model_type')!r} model, expected {MODEL_TYPE!r}")
    fields = {k: raw[k] for k in ExpertPredictorConfig.__dataclass_fields__ if k in raw}
    fields["moe_layers"] = tuple(fields["moe_layers"])
    predictor = ExpertPredictor(ExpertPredictorConfig(**fields))
    predictor.load_state_dict({k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()})
    return predictor.to(device=device, dtype=dtype).eval().requires_grad_(False)
