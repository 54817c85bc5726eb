"""The models an environment runs or a trace was recorded with: zoo names or folders -> target + drafter.

    target, drafter, info = load_models("tiny-moe", "eagle-head", predictor="expert-predictor")
    target, drafter, info = load_models("tiny-moe-fine", "mtp", predictor=None)   # the target's own MTP module
    target, drafter, info = load_models("tiny-moe", "ngram", predictor=None)       # prompt lookup, model-free

`drafter` is an `engine.drafting` Drafter ready for `engine.Engine(target, drafter=drafter)` (a feature-head
folder, a dense HF folder, or None); `info` names both with their weight digests (SHA-256 of the
*.safetensors, 16 hex digits), which a trace records and replay checks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import engine
from engine.drafting.make import make_drafter
from engine.models.eagle3 import is_eagle3_config
from engine.models.feature_heads import target_digest
from engine.paths import repo_relative, zoo_dir

MTP_DRAFTER = "mtp"  # drafter name of a target's own MTP module (engine.drafting.make)
NGRAM_DRAFTER = "ngram"  # prompt lookup (engine.drafting.ngram): no weights, no predictor
NGRAM_DIGEST = "ngram-max4-min1-sel16-scored"  # its "weights": the defaults (max_ngram 4, min_ngram 1), chosen at
# depth 16, scored by match length and follower frequency (engine.drafting.ngram)


@dataclass(frozen=True)
class ModelInfo:
    """Names and digests of a (target, drafter, predictor) triple, as stored in a trace's metadata."""

    target_path: str
    target_digest: str | None
    drafter_name: str
    drafter_path: str | None
    drafter_digest: str | None
    predictor_path: str | None
    predictor_digest: str | None

    def target_meta(self, target: engine.Model) -> dict[str, Any]:
        cfg = target.config
        return {
            "path": self.target_path,
            "digest": self.target_digest,
            "model_type": cfg.model_type,
            "num_moe_layers": len(target.moe_blocks),
            "num_experts": cfg.num_experts if cfg.is_moe else 0,
            "top_r": cfg.top_r if cfg.is_moe else 0,
            "vocab_size": target.vocab_size,
            "hidden_size": cfg.hidden_size,
        }

    def drafter_meta(self) -> dict[str, Any]:
        return {
            "name": self.drafter_name,
            "path": self.drafter_path,
            "digest": self.drafter_digest,
            "predictor": self.predictor_path,
            "predictor_digest": self.predictor_digest,
        }


def resolve_model_path(name: str | Path) -> Path:
    """A zoo name ("tiny-moe", "eagle-head", ...) or a folder (relative paths from the repository root)."""
    p = Path(name)
    if not p.is_absolute() and (zoo_dir() / p / "config.json").is_file():
        return zoo_dir() / p
    path = repo_relative(p)
    if path is None or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {str(name)!r} is neither a zoo name (folders in {zoo_dir()}) nor a folder with config.json"
        )
    return path


def folder_digest(path: str | Path | None) -> str | None:
    """SHA-256 (16 hex digits) of a folder's *.safetensors files (None for no folder)."""
    if path is None:
        return None
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load_models(
    target: str | Path = "tiny-moe",
    drafter: str | Path | None = "eagle-head",
    predictor: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[engine.Model, Any, ModelInfo]:
    """(target Model, Drafter or None, ModelInfo). drafter: a feature-head folder (EAGLE / MTP), a dense HF
    folder, "mtp" (the MTP module inside the target's own checkpoint: DeepSeek-V3 / GLM-4.5, zoo/tiny-moe-fine;
    its path and digest are the target folder's), "ngram" (prompt lookup: no weights, its digest names its settings;
    a predictor is refused, since it reads a model drafter's hidden states), or None; predictor: an
    expert-predictor folder for λ > 0, or None."""
    if str(drafter) == NGRAM_DRAFTER and predictor:
        raise ValueError(f"the n-gram drafter has no hidden states for the expert predictor {predictor!r}: "
                         "pass predictor=null (models.predictor=null)")  # fmt: skip
    target_path = resolve_model_path(target)
    model = engine.load_model(target_path, dtype=dtype)
    drafter_obj = drafter_path = pred_path = None
    mtp = str(drafter) == MTP_DRAFTER
    if str(drafter) == NGRAM_DRAFTER:
        drafter_obj = make_drafter(NGRAM_DRAFTER, model)
    elif drafter is not None and str(drafter) != "":
        pred_path = resolve_model_path(predictor) if predictor else None
        options = {"predictor": str(pred_path)} if pred_path is not None else {}
        if mtp:  # the MTP module shipped in the target's own folder (engine.drafting.mtp_drafter)
            drafter_path = target_path
            drafter_obj = make_drafter(MTP_DRAFTER, model, **options)
        else:
            drafter_path = resolve_model_path(drafter)
            raw = json.loads((drafter_path / "config.json").read_text())
            if raw.get("model_type") in engine.SUPPORTED_MODEL_TYPES and not is_eagle3_config(raw):  # EAGLE-3: a head
                drafter_obj = make_drafter(engine.load_model(drafter_path, dtype=dtype), model, **options)
            else:
                drafter_obj = make_drafter(str(drafter_path), model, **options)
    name = "none" if drafter_path is None else (MTP_DRAFTER if mtp else drafter_path.name)
    if drafter_obj is not None and drafter_path is None:
        name = NGRAM_DRAFTER
    name += f"+{pred_path.name}" if pred_path else ""
    info = ModelInfo(
        target_path=str(target_path),
        target_digest=target_digest(model),
        drafter_name=name,
        drafter_path=None if drafter_path is None else str(drafter_path),
        drafter_digest=folder_digest(drafter_path) if drafter_path is not None or drafter_obj is None else NGRAM_DIGEST,
        predictor_path=None if pred_path is None else str(pred_path),
        predictor_digest=folder_digest(pred_path),
    )
    return model, drafter_obj, info
