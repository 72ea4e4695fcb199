"""A small, readable reference inference engine on top of kvtier.

Models (Llama-style GQA, DeepSeek-style MLA) in plain torch, paged attention
over kvtier's device pools, continuous batching with kvtier's prefix cache
across the GPU and host tiers, greedy decoding.
"""

from .checkpoint import config_from_hf, load_checkpoint, random_model, save_checkpoint
from .config import DEEPSEEK, LLAMA, EngineConfig, ModelConfig, llama3_8b, tiny
from .engine import Engine
from .sequence import Sequence

__all__ = [
    "Engine", "EngineConfig", "ModelConfig", "Sequence", "tiny", "llama3_8b", "LLAMA", "DEEPSEEK",
    "random_model", "load_checkpoint", "save_checkpoint", "config_from_hf",
]
