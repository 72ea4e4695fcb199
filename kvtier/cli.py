"""The ``kvtier`` command line."""

from __future__ import annotations

import importlib

import click

# Subcommands live in their own modules and are imported only when used,
# so `kvtier --help` stays fast and `kvtier info` never imports Triton.
COMMANDS = {
    "info": ("kvtier.commands.info", "info"),
    "demo": ("kvtier.demo", "demo"),
}
BENCH_COMMANDS = {
    "alloc": ("kvtier.bench.alloc", "alloc"),
    "ttft": ("kvtier.bench.ttft", "ttft"),
    "transfer": ("kvtier.bench.transfer", "transfer"),
    "cache": ("kvtier.bench.cache", "cache"),
    "storage": ("kvtier.bench.storage", "storage"),
    "vllm-worker": ("kvtier.bench.transfer_cases", "vllm_worker"),
}


class LazyGroup(click.Group):
    def __init__(self, *args, lazy: dict[str, tuple[str, str]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = lazy or {}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


class MainGroup(LazyGroup):
    """Reports a bad ``KVTIER_*`` environment variable as a usage error, not a traceback."""

    def invoke(self, ctx):
        from .memory import EnvSettingError

        try:
            return super().invoke(ctx)
        except EnvSettingError as e:
            raise click.UsageError(f"{e} (an environment variable: fix or unset it)") from None


@click.group(cls=MainGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: a tiered KV cache for LLM inference (GPU -> host -> storage)."""


@main.group(cls=LazyGroup, lazy=BENCH_COMMANDS)
def bench() -> None:
    """Benchmarks that print a ratio against a baseline measured in the same run."""


if __name__ == "__main__":
    main()
