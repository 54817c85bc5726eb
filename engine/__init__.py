"""expertspec engine: exact MoE speculative decoding over Hugging Face-format checkpoints.

import engine
target = engine.load_model(path)                       # HF folder -> engine.Model
eng = engine.Engine(target, drafter=engine.load_model(drafter_path))   # or "ngram" / None
results = eng.generate(prompts, 64, spec=engine.SpecConfig(depth=4, width=2))
"""

from .checkpoint import CheckpointError, load_model, save_model
from .config import SUPPORTED_MODEL_TYPES, ModelConfig, ModelConfigError
from .draft_tree import DraftTree
from .drafters import ModelDrafter, NGramDrafter
from .eagle import EagleDrafter, load_feature_drafter
from .engine import Engine
from .model import Model
from .sampling import SamplingParams
from .spec import SpecConfig
from .stats import GenerationResult, RoundStats
from .verify import VerifyResult

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
