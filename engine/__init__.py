"""expertspec engine: exact MoE speculative decoding over Hugging Face-format checkpoints.

import engine
target = engine.load_model(path)                       # HF folder -> engine.Model
eng = engine.Engine(target, drafter=engine.load_model(drafter_path))   # or "ngram" / None
results = eng.generate(prompts, 64, spec=engine.SpecConfig(depth=4, width=2))
"""

from engine.drafting.feature_drafter import EagleDrafter
from engine.drafting.make import load_feature_drafter
from engine.drafting.model_drafter import ModelDrafter
from engine.drafting.ngram import NGramDrafter
from engine.models.checkpoint import CheckpointError, load_model, save_model
from engine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, ModelConfigError
from engine.models.transformer import Model
from engine.runtime.engine import Engine
from engine.runtime.stats import GenerationResult, RoundStats
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams
from engine.spec.verify import VerifyResult

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "DraftTree",
    "EagleDrafter",
    "ModelDrafter",
    "NGramDrafter",
    "Engine",
    "GenerationResult",
    "Model",
    "ModelConfig",
    "ModelConfigError",
    "RoundStats",
    "SamplingParams",
    "SpecConfig",
    "VerifyResult",
    "load_feature_drafter",
    "load_model",
    "save_model",
]
