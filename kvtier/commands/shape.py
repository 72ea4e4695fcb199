"""Click options that describe a model's KV shape, shared by every command."""

from __future__ import annotations

import functools

import click

from ..spec import KINDS, PRESETS, KVSpec, parse_dtype, preset


# The kinds each shape flag describes.
FLAG_KINDS = {"--heads": ("mha",), "--head-dim": ("mha",), "--kv-lora-rank": ("mla", "dsa"),
              "--rope-dim": ("mla", "dsa"), "--index-head-dim": ("dsa",)}


def shape_options(func):
    """Add ``--model`` (a preset) and flags that override or replace it."""

    @click.option("--model", "-m", type=click.Choice(sorted(PRESETS)), default=None,
                  help="A model preset. Flags below override its fields.")
    @click.option("--kind", type=click.Choice(KINDS), default=None, help="KV kind (with no preset).")
    @click.option("--layers", type=click.IntRange(min=1), default=None, help="Number of layers.")
    @click.option("--heads", type=click.IntRange(min=1), default=None, help="KV heads (MHA).")
    @click.option("--head-dim", type=click.IntRange(min=1), default=None, help="Head dimension (MHA).")
    @click.option("--kv-lora-rank", type=click.IntRange(min=1), default=None, help="Latent rank (MLA/DSA).")
    @click.option("--rope-dim", type=click.IntRange(min=0), default=None, help="RoPE dims of the latent row (MLA/DSA).")
    @click.option("--index-head-dim", type=click.IntRange(min=128), default=None, help="DSA index-K head dim.")
    @click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32", "fp8"]), default=None, help="KV dtype.")
    @functools.wraps(func)
    def wrapper(*args, model, kind, layers, heads, head_dim, kv_lora_rank, rope_dim, index_head_dim, dtype, **kwargs):
        base = preset(model) if model else None
        if base is not None and kind is not None and kind != base.kind:
            raise click.UsageError(f"--model {model} is a {base.kind.upper()} model; --kind {kind} does not apply "
                                   "(leave --kind out, or leave out --model to describe a model of your own)")
        if base is None and kind is None:
            base = preset("llama-3-8b")
        fields = {
            "kind": kind or base.kind,
            "layer_num": layers or (base.layer_num if base else None),
            "dtype": parse_dtype(dtype) if dtype else (base.dtype if base else "bf16"),
            "head_num": heads or (base.head_num if base else 0),
            "head_dim": head_dim or (base.head_dim if base else 0),
            "kv_lora_rank": kv_lora_rank or (base.kv_lora_rank if base else 0),
            "qk_rope_head_dim": rope_dim if rope_dim is not None else (base.qk_rope_head_dim if base else 0),
            "index_head_dim": index_head_dim or (base.index_head_dim if base else 0),
        }
        if fields["kind"] == "dsa" and not fields["index_head_dim"]:
            fields["index_head_dim"] = 128
        if fields["layer_num"] is None:
            raise click.BadParameter("give --layers (or a --model preset)", param_hint="--layers")
        k = fields["kind"]
        given = {"--heads": heads, "--head-dim": head_dim, "--kv-lora-rank": kv_lora_rank, "--rope-dim": rope_dim,
                 "--index-head-dim": index_head_dim}
        wrong = [f for f, v in given.items() if v is not None and k not in FLAG_KINDS[f]]
        if wrong:
            raise click.UsageError(f"{', '.join(wrong)} do{'es' if len(wrong) == 1 else ''} not apply to a "
                                   f"{k.upper()} model; leave {'it' if len(wrong) == 1 else 'them'} out")
        missing = [f for f, name in (("--heads", "head_num"), ("--head-dim", "head_dim"), ("--kv-lora-rank", "kv_lora_rank"))
                   if k in FLAG_KINDS[f] and not fields[name]]
        if missing:
            raise click.UsageError(f"a {k.upper()} model with no preset needs {' and '.join(missing)}")
        try:
            spec = KVSpec(name=model or "custom", **fields)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        return func(*args, spec=spec, **kwargs)

    return wrapper
