"""Drafter construction: None | "ngram" | "mtp" | a dense Model | a feature-head folder | a Drafter -> a Drafter.

"mtp": the MTP module shipped in the target's own checkpoint folder (DeepSeek-V3 / GLM-4.5;
engine.drafting.mtp_drafter). A folder whose config.json names `LlamaForCausalLMEagle3` is a published EAGLE-3
head (engine.drafting.eagle3_drafter)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.drafting.eagle3_drafter import load_eagle3_drafter
from engine.drafting.feature_drafter import EagleDrafter, MTPDrafter
from engine.drafting.model_drafter import ModelDrafter
from engine.drafting.mtp_drafter import load_mtp_drafter
from engine.drafting.ngram import NGramDrafter
from engine.drafting.protocol import DRAFTER_METHODS, Drafter
from engine.models.eagle3 import is_eagle3_config
from engine.models.expert_predictor import ExpertPredictor, load_expert_predictor
from engine.models.feature_heads import EagleHead, MTPHead, load_head
from engine.models.transformer import Model


def load_feature_drafter(
    path: str | os.PathLike, target: Model, predictor: str | os.PathLike | ExpertPredictor | None = None, **kv_options
) -> EagleDrafter:
    """A head folder (`zoo/eagle-head`, `zoo/mtp-head`, a published EAGLE-3 head) -> EagleDrafter / MTPDrafter /
    Eagle3Drafter over `target`, optionally with an expert predictor (folder or module) for λ > 0."""
    config = Path(path) / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    model_type = raw.get("model_type")
    if isinstance(predictor, (str, os.PathLike)):
        predictor = load_expert_predictor(predictor, target.device)
    if is_eagle3_config(raw):
        return load_eagle3_drafter(path, target, predictor, **kv_options)
    if model_type == EagleHead.model_type:
        return EagleDrafter(load_head(path, target, EagleHead), target, predictor, **kv_options)
    if model_type == MTPHead.model_type:
        return MTPDrafter(load_head(path, target, MTPHead), target, predictor, **kv_options)
    raise ValueError(f"{path} is not a feature-head folder (model_type {model_type!r})")


def make_drafter(drafter: Any, target: Model, **options: Any) -> Drafter | None:
    """None | "ngram" | dense `Model` | Drafter -> Drafter; checks the vocabulary matches the target."""
    if drafter is None:
        if options:
            raise TypeError(f"unknown Engine options {sorted(options)}")
        return None
    if drafter == "mtp":
        predictor = options.pop("predictor", None)
        if isinstance(predictor, (str, os.PathLike)):
            predictor = load_expert_predictor(predictor, target.device)
        return load_mtp_drafter(target, predictor=predictor, **options)
    if isinstance(drafter, (str, os.PathLike)) and drafter != "ngram":
        if (Path(drafter) / "config.json").is_file():  # an EAGLE / MTP head folder (engine.train_heads)
            return load_feature_drafter(drafter, target, **options)
        raise ValueError(f"unknown drafter {drafter!r}; use a Model, 'ngram', 'mtp', a head folder or None")
    if drafter == "ngram":
        return NGramDrafter(target.vocab_size, **options)
    if isinstance(drafter, Model):
        if drafter.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size}): "
                "speculative decoding needs a shared tokenizer"
            )
        return ModelDrafter(drafter, **options)
    missing = [m for m in DRAFTER_METHODS if not callable(getattr(drafter, m, None))]
    if not missing and isinstance(getattr(drafter, "predicts_experts", None), bool):
        return drafter
    if len(missing) < len(DRAFTER_METHODS):
        raise TypeError(
            f"{type(drafter).__name__} is not a complete engine Drafter: missing {missing or ['predicts_experts']} "
            "(see engine.drafting.protocol.Drafter)"
        )
    raise TypeError(f"drafter must be None, 'ngram', an engine.Model or a Drafter, got {type(drafter).__name__}")
