"""The reference engine's models, paged attention and checkpoint loader."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from kvtier.engine import Engine, EngineConfig, ModelConfig, load_checkpoint, random_model, save_checkpoint, tiny
from kvtier.engine.attention import causal_mask, reference_attention, sdpa_attention
from kvtier.engine.checkpoint import config_from_hf, config_to_hf, hf_state_dict
from kvtier.engine.models import Linear, Rotary

F64 = torch.float64
KINDS = ("llama", "deepseek")
SMALL = dict(hidden_size=64, n_layers=2, n_heads=4, intermediate_size=96, vocab_size=97)


def small(kind: str, **kw) -> ModelConfig:
    return tiny(kind, **{**SMALL, **kw})


# -- a dense forward pass with no pool, no pages, no cache --------------------

def dense_logits(model, ids: list[int], rope_pairs: bool = False) -> torch.Tensor:
    """Logits at every position, attention over the whole sequence at once (the textbook way).
    ``rope_pairs``: MLA's RoPE by interleaved pairs, as DeepSeek's checkpoints are made for."""
    cfg = model.config
    x = model.model.embed_tokens(torch.tensor(ids))
    pos = torch.arange(len(ids))
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        x = x + _dense_attention(layer.self_attn, h, pos, cfg, rope_pairs)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


def _by_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...]``: Hugging Face's DeepSeek code does
    this to its RoPE dims before rotating halves, which rotates the pairs (x0, x1), (x2, x3)..."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


def _dense_attention(a, h, pos, cfg, rope_pairs=False):
    n = h.shape[0]
    if cfg.kind == "llama":
        q = a.q_proj(h).view(n, a.n_heads, a.d)
        k = a.k_proj(h).view(n, a.n_kv, a.d)
        v = a.v_proj(h).view(n, a.n_kv, a.d)
        cos, sin = a.rotary.cos_sin(pos, h.dtype)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        k, v = (t.repeat_interleave(a.n_heads // a.n_kv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1).to(F64) for t in (q, k, v)), is_causal=True)
        return a.o_proj(out.transpose(0, 1).reshape(n, -1).to(h.dtype))
    q = a.queries(h).view(n, a.n_heads, a.nope + a.rope)
    q_nope, q_pe = q.split([a.nope, a.rope], dim=-1)
    latent, k_pe = a.kv_a_proj_with_mqa(h).split([a.rank, a.rope], dim=-1)
    if rope_pairs:
        q_pe, k_pe = _by_pairs(q_pe), _by_pairs(k_pe)
    cos, sin = a.rotary.cos_sin(pos, h.dtype)
    q = torch.cat((q_nope, Rotary.apply(q_pe, cos, sin)), -1)
    k_pe = Rotary.apply(k_pe[:, None], cos, sin)
    kv = a.kv_b_proj(a.kv_a_layernorm(latent)).view(n, a.n_heads, a.nope + a.dv)
    k_nope, v = kv.split([a.nope, a.dv], -1)
    k = torch.cat((k_nope, k_pe.expand(n, a.n_heads, a.rope)), -1)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1).to(F64) for t in (q, k, v)), is_causal=True,
                                         scale=a.scale)
    return a.o_proj(out.transpose(0, 1).reshape(n, -1).to(h.dtype))


def dense_greedy(model, prompt: list[int], steps: int, rope_pairs: bool = False) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(dense_logits(model, ids, rope_pairs)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_engine_matches_dense_forward(kind, page_size):
    """Prefill + decode through the pool's page table gives the dense model's tokens."""
    cfg = small(kind)
    engine = Engine.build(cfg, EngineConfig(prefix_cache="none", device_tokens=512, page_size=page_size), seed=3)
    prompts = [[5, 9, 2, 44, 17, 3, 8], list(range(1, 40)), [11]]
    got = engine.generate(prompts, max_new_tokens=6)
    for prompt, out in zip(prompts, got):
        assert out == dense_greedy(engine.model, prompt, 6)
    assert engine.kv.allocator.available_size() == engine.kv.capacity


@pytest.mark.parametrize("kind", KINDS)
def test_kv_in_pool_equals_dense_keys(kind):
    """What a prefill writes into the pool is the model's K/V (or latent row) at each position."""
    cfg = small(kind)
    engine = Engine.build(cfg, EngineConfig(prefix_cache="none", device_tokens=128, page_size=4), seed=1)
    seq = engine.add_request([3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=2)
    engine.step()  # prefill only
    a = engine.model.model.layers[0].self_attn
    h = engine.model.model.layers[0].input_layernorm(engine.model.model.embed_tokens(torch.tensor(seq.token_ids[:8])))
    slots = torch.tensor(seq.slots[:8])
    if kind == "llama":
        cos, sin = a.rotary.cos_sin(torch.arange(8), h.dtype)
        k = Rotary.apply(a.k_proj(h).view(8, a.n_kv, a.d), cos, sin)
        torch.testing.assert_close(engine.pool.k_buffer[0][slots], k, rtol=0, atol=0)
        torch.testing.assert_close(engine.pool.v_buffer[0][slots], a.v_proj(h).view(8, a.n_kv, a.d), rtol=0, atol=0)
    else:
        latent = a.kv_a_layernorm(a.kv_a_proj_with_mqa(h)[:, : a.rank])
        torch.testing.assert_close(engine.pool.kv_buffer[0][slots][:, 0, : a.rank], latent, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), q_start=st.integers(0, 12), kv_heads=st.sampled_from([1, 2, 3]),
       group=st.sampled_from([1, 2, 4]), d=st.sampled_from([4, 8, 12]), dv=st.sampled_from([4, 8]),
       seed=st.integers(0, 2**16))
def test_sdpa_attention_matches_reference(n, q_start, kv_heads, group, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, kv_heads * group, d, generator=g)
    k = torch.randn(q_start + n, kv_heads, d, generator=g)
    v = torch.randn(q_start + n, kv_heads, dv, generator=g)
    ref = reference_attention(F64)(q, k, v, q_start, d ** -0.5)
    fast = sdpa_attention()(q, k, v, q_start, d ** -0.5)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    # the last query of a causal block sees every key: plain softmax attention
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("hd,khd->hk", q[-1].double(), kk.double()) * d ** -0.5, -1)
    torch.testing.assert_close(ref[-1].double(), torch.einsum("hk,khd->hd", w, vv.double()), rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), q_start=st.integers(0, 12), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), max_scores=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_reference_attention_in_blocks_of_queries_matches_one_block(n, q_start, kv_heads, group, max_scores, seed):
    """Bounding the scores splits the queries into blocks, each attending to the keys up to its
    last query: the result is the single block's (float64 accumulation, fp32 out), whatever the split."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, kv_heads * group, 8, generator=g)
    k = torch.randn(q_start + n, kv_heads, 8, generator=g)
    v = torch.randn(q_start + n, kv_heads, 4, generator=g)
    whole = reference_attention(F64, max_scores=1 << 30)(q, k, v, q_start, 8 ** -0.5)
    blocks = reference_attention(F64, max_scores=max_scores)(q, k, v, q_start, 8 ** -0.5)
    assert blocks.dtype == q.dtype and blocks.shape == (n, kv_heads * group, 4)
    torch.testing.assert_close(blocks, whole, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="max_scores must be >= 1, got 0"):
        reference_attention(F64, max_scores=0)


def test_reference_attention_of_a_long_prefill_holds_its_scores_within_the_bound():
    """An 8k-token prefill of 8 query heads: whole, its float64 scores alone are 4.3 GB (and the
    softmax as much); in blocks the process's peak memory grows by well under 1.5 GB. Measured as
    the peak resident size of a fresh process, before and after."""
    import subprocess
    import sys
    code = """
import resource, torch
from kvtier.engine.attention import reference_attention
torch.manual_seed(0)
n, kv, group, d = 8192, 2, 4, 32
q, k, v = torch.randn(n, kv * group, d), torch.randn(n, kv, d), torch.randn(n, kv, d)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = reference_attention(torch.float64)(q, k, v, 0, d ** -0.5)
assert torch.isfinite(out).all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    grew = int(res.stdout.strip().splitlines()[-1])
    assert 0 <= grew < 1.5e9, f"peak memory grew by {grew / 1e9:.2f} GB"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": True}, {"q_lora_rank": 24}, {"dtype": torch.bfloat16}])
def test_weight_bytes_counts_what_the_model_holds_and_a_model_too_large_is_refused_first(kind, variant):
    """``weight_bytes`` (from the shape) equals the built model's bytes; a model larger than
    the host's available memory is refused by name and size before any weight is allocated."""
    from kvtier.engine.engine import make_model, weight_bytes
    from kvtier.memory import host_memory
    cfg = small(kind, n_kv_heads=1, **variant)
    model = random_model(cfg, 0)
    assert weight_bytes(cfg) == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if variant:
        return
    # An embedding table alone larger than the host: refused, never built (not even its first rows).
    vocab = int(2 * host_memory(0).available / (4 * cfg.hidden_size)) + 1
    huge = small(kind, vocab_size=vocab)
    with pytest.raises(MemoryError, match=r"float32 weights\) needs [0-9.]+ GB of host memory but only [0-9.]+ GB "
                                          r"is available .* Run it on a GPU .* or take a smaller model"):
        make_model(huge, EngineConfig(device="cpu"))


def test_rotary_tables_match_the_formula_and_reach_a_device_once():
    """cos/sin of positions x inv_freq (rotate-half: each frequency twice), in float64 before
    rounding; the frequencies are copied to a device once and reused, not at every call."""
    r = Rotary(8, 10000.0)
    pos = torch.tensor([0, 1, 5, 4095])
    cos, sin = r.cos_sin(pos, torch.float32)
    freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=F64) / 8)
    ang = pos.to(F64)[:, None] * torch.cat((freq, freq))[None, :]
    torch.testing.assert_close(cos, ang.cos().float(), rtol=0, atol=0)
    torch.testing.assert_close(sin, ang.sin().float(), rtol=0, atol=0)
    first = r._inv_freq_on[pos.device]
    r.cos_sin(pos[:2], torch.bfloat16)
    assert r._inv_freq_on[pos.device] is first and len(r._inv_freq_on) == 1


def test_causal_mask_offsets():
    m = causal_mask(3, 2, "cpu")
    assert m.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]


def test_exact_linear_is_batch_invariant():
    """With float64 accumulation, a row's output does not depend on the other rows of the batch."""
    lin = Linear(96, 200, acc=F64)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(300, 96)
    full = lin(x)
    assert all(torch.equal(full[i : i + 1], lin(x[i : i + 1])) for i in range(0, 300, 7))
    assert torch.equal(full[10:40], lin(x[10:40]))


@pytest.mark.parametrize("kind", KINDS)
def test_sdpa_engine_generates_same_tokens(kind):
    cfg = small(kind)
    outs = []
    for attention in ("reference", "sdpa"):
        e = Engine.build(cfg, EngineConfig(prefix_cache="none", device_tokens=256, attention=attention), seed=4)
        outs.append(e.generate([[1, 2, 3, 4, 5, 6], [7, 7, 7]], max_new_tokens=5))
    assert outs[0] == outs[1]


# -- checkpoints -----------------------------------------------------------------

def _hf_dir(tmp_path, model, hf_overrides=None, drop=(), reshape=None):
    """Write a checkpoint by hand, as a Hugging Face export would: config.json + safetensors."""
    hf = {**config_to_hf(model.config), **(hf_overrides or {})}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    state = {k: v.clone() for k, v in hf_state_dict(model).items() if k not in drop}
    if reshape:
        state[reshape] = state[reshape][:-1]
    keys = sorted(state)
    half = len(keys) // 2  # two shards, as big checkpoints come
    save_file({k: state[k].contiguous() for k in keys[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k].contiguous() for k in keys[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    return tmp_path


@pytest.mark.parametrize("cfg", [
    small("llama"), small("llama", tie_embeddings=True, n_kv_heads=4),
    small("deepseek"), small("deepseek", q_lora_rank=24),
], ids=["llama", "llama-tied-mha", "deepseek", "deepseek-q-lora"])
def test_checkpoint_round_trip(tmp_path, cfg):
    model = random_model(cfg, seed=7)
    path = _hf_dir(tmp_path, model, drop=("lm_head.weight",) if cfg.tie_embeddings else ())
    loaded = load_checkpoint(path)
    assert loaded.config == cfg
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    prompt = [4, 8, 15, 16, 23, 42]
    a = Engine(model, EngineConfig(prefix_cache="none", device_tokens=64)).generate([prompt], 4)
    b = Engine(loaded, EngineConfig(prefix_cache="none", device_tokens=64)).generate([prompt], 4)
    assert a == b


@pytest.mark.parametrize("q_lora", [0, 24])
def test_a_deepseek_checkpoint_runs_as_its_rope_by_pairs_says(tmp_path, q_lora):
    """DeepSeek's checkpoints are made for RoPE by interleaved pairs (Hugging Face's and vLLM's
    DeepSeek code); the engine rotates halves, and loaded the tensors as they were: every
    position's phase was wrong (a review, 2026-12-04). The file's own tensors, run as Hugging
    Face runs them, must give the engine's tokens."""
    from safetensors.torch import load_file

    from kvtier.engine.models import build_model
    cfg = small("deepseek", q_lora_rank=q_lora)
    path = save_checkpoint(random_model(cfg, seed=5), tmp_path / "ckpt")
    assert json.loads((path / "config.json").read_text())["rope_interleave"] is True
    as_filed = build_model(cfg)
    as_filed.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    prompt = [5, 9, 2, 44, 17, 3, 8, 60, 61, 12, 33, 70]
    with torch.no_grad():  # the convention matters: by halves, the file's tensors give other logits
        assert not torch.allclose(dense_logits(as_filed, prompt, rope_pairs=True), dense_logits(as_filed, prompt))
    want = dense_greedy(as_filed, prompt, 6, rope_pairs=True)
    loaded = load_checkpoint(path)
    assert Engine(loaded, EngineConfig(prefix_cache="none", device_tokens=64)).generate([prompt], 6)[0] == want


def test_save_checkpoint_then_engine_build(tmp_path):
    cfg = small("deepseek")
    model = random_model(cfg, seed=2)
    save_checkpoint(model, tmp_path / "ckpt")
    e = Engine.build(cfg, EngineConfig(prefix_cache="none", device_tokens=64), checkpoint=str(tmp_path / "ckpt"))
    ref = Engine(model, EngineConfig(prefix_cache="none", device_tokens=64))
    assert e.generate([[1, 2, 3]], 5) == ref.generate([[1, 2, 3]], 5)


def test_checkpoint_bf16_dtype_override(tmp_path):
    model = random_model(small("llama"), seed=2)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path, dtype="bf16")
    assert loaded.config.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())


def test_checkpoint_errors(tmp_path):
    model = random_model(small("llama"), seed=0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config_to_hf(model.config)))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(ValueError, match="missing.*q_proj"):
        load_checkpoint(_hf_dir(tmp_path / "a", model, drop=("model.layers.0.self_attn.q_proj.weight",)))
    with pytest.raises(ValueError, match="wrong shapes.*embed_tokens"):
        load_checkpoint(_hf_dir(tmp_path / "b", model, reshape="model.embed_tokens.weight"))


@pytest.mark.parametrize("hf, match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"n_routed_experts": 8}, "mixture-of-experts"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"attention_bias": True}, "bias"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"vocab_size": None}, r"config.json lacks \['vocab_size'\]"),
])
def test_config_from_hf_rejects_unsupported(hf, match):
    base = config_to_hf(small("llama"))
    with pytest.raises(ValueError, match=match):
        config_from_hf({k: v for k, v in {**base, **hf}.items() if v is not None})


@pytest.mark.parametrize("kw, match", [
    (dict(kind="gpt"), "unknown model kind"),
    (dict(n_heads=6, n_kv_heads=4), "multiple of n_kv_heads"),
    (dict(head_dim=7), "even"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(kind="deepseek", qk_rope_head_dim=5), "even"),
])
def test_model_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**SMALL, **kw})


def test_rope_theta_is_read_from_transformers_5_rope_parameters():
    """transformers >= 5 writes rope_parameters in place of rope_theta: read there, theta was
    silently 10,000 for a Llama-3 checkpoint (500,000); a plain rope_theta still counts."""
    base = {k: v for k, v in config_to_hf(small("llama")).items() if k != "rope_theta"}
    assert config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_theta == 5e5
    assert config_from_hf({**base, "rope_theta": 2e5}).rope_theta == 2e5
    assert config_from_hf({**base, "hidden_act": "silu"}).kind == "llama"


def test_a_sharded_checkpoint_loads_the_files_its_index_names_only(tmp_path):
    """A Hugging Face directory may hold the same weights twice (Mistral's consolidated.safetensors
    beside the shards, under other tensor names): with model.safetensors.index.json only the
    files it names are read (every *.safetensors was, and the directory was refused)."""
    model = random_model(small("llama"), 0)
    d = _hf_dir(tmp_path / "ckpt", model)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    from safetensors.torch import load_file
    weight_map = {k: f for f in shards for k in load_file(str(d / f))}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(d / "consolidated.safetensors"))
    loaded = load_checkpoint(d)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    (d / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match="names files that are not in"):
        load_checkpoint(d)


def test_a_sliding_window_checkpoint_is_refused_by_name():
    """Mistral's first models attend within a 4,096-token window; the engine attends to the whole
    context, so it refuses them rather than run them differently (a review, 2026-12-04)."""
    hf = {**config_to_hf(small("llama")), "model_type": "mistral", "sliding_window": 4096}
    with pytest.raises(ValueError, match="sliding_window=4096 is not implemented"):
        config_from_hf(hf)
    assert config_from_hf({**hf, "sliding_window": None}).kind == "llama"


@pytest.mark.parametrize("make", [lambda: sdpa_attention(torch.float64), lambda: reference_attention(torch.float64)])
def test_exact_attention_gives_the_same_bits_with_or_without_a_cached_prefix(make):
    """The engine's exact mode (CPU, fp32 weights) accumulates attention in float64, so the rows a
    prefix hit recomputes come out as they did in the whole prompt's prefill: outputs do not
    depend on what the cache reused. The fused path ignored float64 (a review, 2026-12-04: a
    prefix hit moved the logits by up to 5e-7)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((48, 4), (48, 2), (48, 2)))
    attend = make()
    whole = attend(q, k, v, 0, 0.25)
    assert whole.dtype == torch.float32
    for start in (8, 24, 47):
        assert torch.equal(attend(q[start:], k, v, start, 0.25), whole[start:]), start
