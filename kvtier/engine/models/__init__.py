"""The models the reference engine runs, one per file."""

from __future__ import annotations

import torch

from ..attention import attention_impl
from ..config import DEEPSEEK, LLAMA, ModelConfig
from .decoder import CausalLM
from .deepseek import deepseek
from .llama import llama

BUILDERS = {LLAMA: llama, DEEPSEEK: deepseek}


def build_model(cfg: ModelConfig, device="cpu", attention: str = "reference",
                acc: torch.dtype | None = None) -> CausalLM:
    """An uninitialised model of ``cfg``'s kind, its parameters in ``cfg.dtype`` on ``device``."""
    attend = attention_impl(attention, acc)
    with torch.device(device):
        model = BUILDERS[cfg.kind](cfg, attend, acc)
    return model.to(dtype=cfg.dtype).eval().requires_grad_(False)


__all__ = ["BUILDERS", "CausalLM", "build_model", "llama", "deepseek"]
