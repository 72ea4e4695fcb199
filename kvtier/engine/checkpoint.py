"""Models from a local Hugging Face-format directory, or random from a seed.

A checkpoint directory holds ``config.json`` and one or more
``*.safetensors`` files whose tensor names are Hugging Face's. Nothing is
ever downloaded: a path that is not such a directory is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .config import DEEPSEEK, LLAMA, ModelConfig
from .models import CausalLM, build_model

HF_TYPES = {"llama": LLAMA, "mistral": LLAMA, "deepseek_v2": DEEPSEEK, "deepseek_v3": DEEPSEEK}


def config_from_hf(hf: dict, dtype: torch.dtype | str | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from the fields of a Hugging Face ``config.json``."""
    mtype = hf.get("model_type")
    if mtype not in HF_TYPES:
        raise ValueError(f"model_type {mtype!r} is not supported; the reference engine runs {sorted(HF_TYPES)}")
    if hf.get("n_routed_experts"):
        raise ValueError("mixture-of-experts layers (n_routed_experts) are not implemented; "
                         "the reference engine runs dense SwiGLU MLPs only")
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling={hf['rope_scaling']!r} is not implemented; only plain RoPE is")
    # transformers >= 5 writes the RoPE settings as rope_parameters (theta and scaling together).
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters={rope!r} is not a mapping")
    if rope.get("rope_type", "default") != "default" or rope.get("type", "default") != "default":
        raise ValueError(f"rope_parameters={rope!r} is not implemented; only plain RoPE (rope_type 'default') is")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r} is not implemented; the MLPs here are SwiGLU (silu)")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise ValueError(f"sliding_window={hf['sliding_window']!r} is not implemented: every token attends "
                         "to the whole context here, so longer prompts would attend differently")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not implemented (the models have no biases)")
    kind = HF_TYPES[mtype]
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    if kind != LLAMA:
        need += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    if missing := [k for k in need if k not in hf]:
        raise ValueError(f"config.json lacks {missing} (model_type {mtype!r} needs them)")
    heads = hf["num_attention_heads"]
    common = dict(
        kind=kind, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads, intermediate_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype or hf.get("torch_dtype") or "float32",
    )
    if kind == LLAMA:
        return ModelConfig(
            **common, n_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        )
    return ModelConfig(
        **common, kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` fields that :func:`config_from_hf` reads back to ``cfg``."""
    hf = {
        "model_type": "llama" if cfg.kind == LLAMA else "deepseek_v2",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.intermediate_size, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": str(cfg.dtype).removeprefix("torch."),
    }
    if cfg.kind == LLAMA:
        hf.update(num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
    else:
        hf.update(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
                  qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                  v_head_dim=cfg.v_head_dim, rope_interleave=True)
    return hf


def random_model(cfg: ModelConfig, seed: int = 0, device="cpu", **build) -> CausalLM:
    """A model of ``cfg`` with weights drawn from ``seed`` (the same seed gives the same weights)."""
    return build_model(cfg, device, **build).init_random(seed)


def checkpoint_config(path: str | Path, dtype=None, tensors: bool = False) -> ModelConfig:
    """The model config of a local Hugging Face-format directory, from its ``config.json``, after
    checking that it has ``*.safetensors`` files too. ``tensors``: also that their tensors are
    the config's, names and shapes, from the files' headers (no weight is read); raises as
    :func:`load_checkpoint` would."""
    path = Path(path)
    cfg = config_from_hf(_hf_config(path), dtype)
    if tensors:
        shapes = {}
        for f in checkpoint_files(path):
            with safe_open(str(f), "pt") as fh:
                shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
        _check_state(build_model(cfg, "meta"), shapes)
    return cfg


def _hf_config(path: Path) -> dict:
    """``path``'s ``config.json``, checked to sit beside ``*.safetensors`` files."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: a checkpoint is a local directory with "
                                "config.json and *.safetensors (nothing is downloaded)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    try:
        doc = json.loads(cfg_file.read_text())
    except ValueError as err:
        raise ValueError(f"{cfg_file} is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{cfg_file} holds a JSON {type(doc).__name__}, not the object of a model's config")
    return doc


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory: those its ``model.safetensors.index.json``
    names where it has one (a directory may also hold the same weights in another layout,
    such as Mistral's ``consolidated.safetensors``), else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return sorted(path.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a safetensors index (a 'weight_map' of tensor -> file): {err}") from None
    if missing := [n for n in names if not (path / n).is_file()]:
        raise FileNotFoundError(f"{index} names files that are not in {path}: {missing[:3]}")
    return [path / n for n in names]


def load_checkpoint(path: str | Path, device="cpu", dtype=None, **build) -> CausalLM:
    """The model in a local Hugging Face-format directory (``config.json`` + ``*.safetensors``).

    Raises ``FileNotFoundError`` for a missing directory or files and
    ``ValueError`` when the tensors do not match the config (naming the
    first missing, unexpected or misshapen tensors).
    """
    path = Path(path)
    hf = _hf_config(path)
    cfg = config_from_hf(hf, dtype)
    files = checkpoint_files(path)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    model = build_model(cfg, device, **build)
    _check_state(model, state)
    if cfg.kind == DEEPSEEK and hf.get("rope_interleave", True):
        _rope_rows(state, cfg, to_half=True)
    model.load_state_dict(state, strict=False)
    return model


def _rope_rows(state: dict[str, torch.Tensor], cfg: ModelConfig, to_half: bool) -> None:
    """DeepSeek checkpoints rotate their RoPE dims in interleaved pairs, ``(x0, x1), (x2, x3)``,
    ..., as Hugging Face's and vLLM's DeepSeek code does; the model here rotates halves,
    ``(x_i, x_{i + d/2})``. Rotating ``x[p]`` by halves, ``p = [0, 2, 4, ..., 1, 3, 5, ...]``, is
    rotating ``x`` by pairs, then reordered: so the rows that make the rope part of every query
    head and the shared rope key are put in ``p``'s order as they load (``to_half``), and back
    as they are saved. Queries and keys are reordered alike, so every score is the same."""
    d, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    p = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    order = p if to_half else torch.argsort(p)
    for name, w in state.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            heads = w.view(cfg.n_heads, nope + d, -1).clone()
            heads[:, nope:] = heads[:, nope:][:, order]
            state[name] = heads.view(w.shape)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            w = w.clone()
            w[cfg.kv_lora_rank:] = w[cfg.kv_lora_rank:][order]
            state[name] = w


def _check_state(model: CausalLM, state: dict) -> None:
    """``state`` (tensors, or their shapes) holds ``model``'s tensors, named and shaped as its own;
    a tied ``lm_head.weight`` is dropped from it."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    shape = {k: tuple(getattr(v, "shape", v)) for k, v in state.items()}
    missing = sorted(set(expected) - set(shape))
    unexpected = sorted(set(shape) - set(expected))
    wrong = [f"{k} {shape[k]} != {s}" for k, s in expected.items() if k in shape and shape[k] != s]
    if missing or unexpected or wrong:
        raise ValueError(
            "checkpoint does not match its config.json: "
            f"missing {missing[:4]}, unexpected {unexpected[:4]}, wrong shapes {wrong[:4]}"
        )


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """``model``'s tensors as a Hugging Face export holds them (on the CPU, contiguous): tied
    embeddings once, and DeepSeek's RoPE rows in its pairwise order (:func:`_rope_rows`)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    if model.config.kind == DEEPSEEK:
        _rope_rows(state, model.config, to_half=False)
    return state


def save_checkpoint(model: CausalLM, path: str | Path) -> Path:
    """Write ``model`` as ``config.json`` + ``model.safetensors`` into directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2))
    save_file(hf_state_dict(model), str(path / "model.safetensors"))
    return path
