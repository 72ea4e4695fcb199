"""What the CLI's commands share: output paths, checks of their flags, and the options that
describe a model's KV shape."""

from __future__ import annotations

import functools
import json
import math
import os

import click

from ..spec import KINDS, PRESETS, KVSpec, parse_dtype, preset


class OutputPath(click.ParamType):
    """A file the command will write when it is done: refused up front, before any work, if it
    is a directory or its directory does not exist or cannot be written ('' for none).
    ``stdout``: '-' names standard output (:func:`write_json`)."""

    name = "path"

    def __init__(self, stdout: bool = False):
        self.stdout = stdout

    def convert(self, value, param, ctx):
        if value in (None, "") or (self.stdout and value == "-"):
            return value
        path = os.fspath(value)
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            self.fail(f"{path!r} is a directory; name a file in it", param, ctx)
        if not os.path.isdir(parent):
            self.fail(f"{parent!r} does not exist; create it first, or name a file in an existing directory",
                      param, ctx)
        if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            self.fail(f"{path!r} cannot be written here; name a file in a writable directory", param, ctx)
        # Where nothing is there yet, make the file as the command will and take it away again
        # (access() says yes to root for /proc and read-only mounts). Anything already there (a
        # file, a link, a FIFO, /dev/null) is left alone: opening a FIFO would hand its reader
        # an end of file, and following a dangling link would leave its target behind.
        if not os.path.lexists(path):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except OSError as e:
                self.fail(f"{path!r} cannot be written ({e.strerror}); name a file in a writable directory",
                          param, ctx)
            os.close(fd)
            os.remove(path)
        return path


OUTPUT_PATH = OutputPath()
JSON_PATH = OutputPath(stdout=True)
JSON_HELP = "Write the results as JSON here ('-': to stdout, and the tables to stderr)."


def echo_for(json_path):
    """``click.echo`` for a command's tables and notes: to stderr where its JSON goes to stdout."""
    return functools.partial(click.echo, err=json_path == "-")


def write_json(path: str, doc, said: str = "wrote {}", flag: str = "--json", **dump_kw) -> None:
    """Write ``doc`` as JSON to ``path`` ('-': stdout), then echo ``said`` (a file's name in
    it; '' for nothing); a one-line click error naming ``flag`` where it cannot be written
    (/dev/full)."""
    text = json.dumps(doc, **dump_kw)
    if path == "-":
        click.echo(text)
        return
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise click.ClickException(f"cannot write {flag} {path}: {e.strerror or e}") from None
    if said:
        click.echo(said.format(path))


class FiniteFloat(click.ParamType):
    """A finite float of at least ``low`` (more than it where ``strict``) and at most ``high``:
    click's FloatRange lets nan and inf through."""

    name = "float"

    def __init__(self, low: float = 0.0, strict: bool = False, high: float = math.inf):
        self.low, self.strict, self.high = low, strict, high

    def convert(self, value, param, ctx):
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x) or x < self.low or (self.strict and x == self.low):
            self.fail(f"{value!r}: give a finite number {'above' if self.strict else 'of at least'} {self.low:g}",
                      param, ctx)
        if x > self.high:
            self.fail(f"{value!r} is more than any machine has: give at most {self.high:.3g}", param, ctx)
        return x


FINITE_POSITIVE = FiniteFloat(0.0, strict=True)

# What a figure can be written as: matplotlib takes the format from the name (it writes a name
# without one as NAME.png, and fails on an unknown one only after the whole run). These are the
# formats its default backends write.
FIGURE_SUFFIXES = (".png", ".svg", ".pdf", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp",
                   ".pgf", ".raw", ".rgba")


class FigurePath(OutputPath):
    """An :class:`OutputPath` for a figure: its name must end in one of ``FIGURE_SUFFIXES``."""

    name = "figure"

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        if path and not path.lower().endswith(FIGURE_SUFFIXES):
            self.fail(f"cannot draw {path!r}: name a file of a format matplotlib writes, e.g. figure.png, .svg or "
                      f".pdf (any of {' '.join(FIGURE_SUFFIXES)})", param, ctx)
        return path


FIGURE_PATH = FigurePath()


def distinct_outputs(**paths) -> None:
    """Refuse two output flags naming the same file (one would overwrite the other)."""
    seen: dict[str, str] = {}
    for flag, path in paths.items():
        if path:
            real = os.path.realpath(path)
            if real in seen:
                raise click.BadParameter(f"--{seen[real]} and --{flag} both name {path!r}; give each its own file",
                                         param_hint=f"--{flag}")
            seen[real] = flag


def check_device_flag(device: str):
    """``--device``: a torch device kvtier runs on, here; a click error naming the flag otherwise."""
    import torch

    from ..validate import device_type

    if device_type(device) is None:
        raise click.BadParameter(f"{device!r} is no device; use cpu or cuda", param_hint="--device")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise click.BadParameter(f"{device!r}: kvtier runs on cpu or cuda", param_hint="--device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"{device!r} but CUDA is not available here; use cpu", param_hint="--device")
    return dev


def check_engine_flags(device: str, layout: str | None, kind: str | None, io_backends=(),
                       backend_flag: str = "--io-backend") -> None:
    """``--device``, ``--layout`` (for a model whose KV is of ``kind``) and ``--io-backend``
    values, checked before any work: click errors naming the flag and the choices."""
    from ..layouts import get_layout
    from ..transfer.factory import IO_BACKENDS, get_backend

    dev = check_device_flag(device)
    if layout is not None and kind is not None:
        try:
            get_layout(layout, kind)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--layout") from None
    for b in io_backends:
        if b is None:
            continue
        if b not in IO_BACKENDS:
            raise click.BadParameter(f"unknown io backend {b!r}; use one of {list(IO_BACKENDS)}",
                                     param_hint=backend_flag)
        try:
            get_backend(b, dev)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=backend_flag) from None


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
