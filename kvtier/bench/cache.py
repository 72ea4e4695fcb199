"""``kvtier bench cache``: the prefix cache's hot path against other trees, on one workload in one run.

The trees cache conversations that share a ``--system``-token system prompt, grown until
each holds ``--sizes`` tokens: each conversation continues a random earlier one from a random
page boundary with fresh tokens, ``--prompt`` tokens in all. At each size and page size, the
same lists and tensors go to

- kvtier's :class:`~kvtier.cache.HiCache`, twice: one cache fed Python lists, one fed CPU
  tensors (each keeps tokens in the form it is given: :mod:`kvtier.cache.radix`);
- :class:`ReferenceRadixTree`, a plain radix tree that compares token by token (lists);
- SGLang's ``RadixCache`` where ``sglang`` is installed (lists, as SGLang's scheduler holds
  them); a ``pip install --no-deps sglang`` does (:func:`load_sglang`).

and three operations are timed (median of ``--repeats``, each tree in turn):

- ``match``: a ``--prompt``-token prompt whose first ``--hit`` tokens are cached;
- ``insert``: a new prompt (the system prompt, then fresh tokens);
- ``insert_hit``: the match's prompt (``--hit`` tokens cached, the rest new).

Each insert is taken out of its tree again once timed, so every repeat meets the same tree.
Inserts into kvtier get their device slots as an engine does (the match's, then new ones),
built just before the timed call. Bytes per cached token: what each tree holds (its objects,
numpy arrays and tensor storage, :func:`deep_bytes`) over the tokens it caches.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass

import click
import numpy as np
import torch
from tqdm import tqdm

from ..cache import CacheConfig, HiCache
from ..commands import FINITE_POSITIVE, JSON_HELP, JSON_PATH, echo_for, write_json
from ..device_pool import MHATokenToKVPool

VOCAB = 128_000
OPS = ("match", "insert", "insert_hit")
TREES = ("tensor", "list", "reference", "sglang")
# Row fields per operation: kvtier from a tensor, from a list, the token tree, SGLang.
COLUMNS = {"match": ("match_us", "match_list_us", "reference_match_us", "sglang_match_us"),
           "insert": ("insert_us", "insert_list_us", "reference_insert_us", "sglang_insert_us"),
           "insert_hit": ("insert_hit_us", "insert_hit_list_us", "reference_insert_hit_us", "sglang_insert_hit_us")}
# Above page 1, inserts are timed again with CacheConfig(check_slots=False) (one slot read a page).
UNCHECKED = {"insert": ("insert_unchecked_us", "insert_unchecked_list_us"),
             "insert_hit": ("insert_hit_unchecked_us", "insert_hit_unchecked_list_us")}


# -- the token-by-token baseline -----------------------------------------------------------

class RefNode:
    __slots__ = ("key", "value", "children")

    def __init__(self, key: list[int], value: list[int]):
        self.key, self.value = key, value
        self.children: dict[int, RefNode] = {}


def _common(key: list[int], tokens: list[int], pos: int) -> int:
    n = min(len(key), len(tokens) - pos)
    i = 0
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i


class ReferenceRadixTree:
    """How a plain Python prefix cache works: one token a step, lists for keys and slot
    values, children keyed by their first token. Correct and simple: the baseline."""

    def __init__(self):
        self.root = RefNode([], [])
        self.size = 0

    def match(self, tokens: list[int]) -> list[int]:
        """Slot values of the longest cached prefix of ``tokens``."""
        node, pos, out = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.key, tokens, pos)
            out += child.value[:k]
            pos += k
            if k < len(child.key):
                break
            node = child
        return out

    def insert(self, tokens: list[int], values: list[int]) -> int:
        """Cache ``tokens`` with ``values``; returns how many were already cached."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = RefNode(tokens[pos:], values[pos:])
                self.size += len(tokens) - pos
                return pos
            k = _common(child.key, tokens, pos)
            if k < len(child.key):
                upper = RefNode(child.key[:k], child.value[:k])
                child.key, child.value = child.key[k:], child.value[k:]
                upper.children[child.key[0]] = child
                node.children[tokens[pos]] = upper
                child = upper
            pos += k
            node = child
        return pos

    def remove_leaf(self, tokens: list[int], start: int) -> None:
        """Take out the leaf that holds ``tokens[start:]`` (what an insert of ``tokens`` added)."""
        node, pos = self.root, 0
        while pos < start:
            node = node.children[tokens[pos]]
            pos += len(node.key)
        leaf = node.children.pop(tokens[start])
        self.size -= len(leaf.key)


# -- SGLang's RadixCache, where installed ----------------------------------------------------

def load_sglang():
    """SGLang's ``radix_cache`` module, or None where ``sglang`` is not installed.

    Under a ``--no-deps`` install its module imports packages it does not need for a
    device-only tree (triton, zmq, a model zoo): those few modules are stood in for by
    empty ones, and the tree itself (``radix_cache``, its base class and eviction
    strategies) is SGLang's own code.
    """
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.import_module("sglang.srt.mem_cache.radix_cache")
    except ImportError:
        pass
    stand_ins = {"sglang.srt.mem_cache.allocator": ["BaseTokenToKVPoolAllocator"],
                 "sglang.srt.mem_cache.memory_pool": ["ReqToTokenPool"],
                 "sglang.srt.metrics.collector": ["RadixCacheMetricsCollector"],
                 "sglang.srt.disaggregation.kv_events": ["AllBlocksCleared", "BlockRemoved", "BlockStored"],
                 "sglang.srt.mem_cache.hicache_storage": ["get_hash_str", "hash_str_to_int64"],
                 "sglang.srt.mem_cache.utils": ["convert_to_bigram_key"]}
    for name, attrs in stand_ins.items():
        if name not in sys.modules:
            module = sys.modules[name] = types.ModuleType(name)
            module.__dict__.update({a: type(a, (), {}) for a in attrs})
    try:
        return importlib.import_module("sglang.srt.mem_cache.radix_cache")
    except Exception as e:  # noqa: BLE001 - another version's imports: the column is left out
        tqdm.write(f"note: sglang is installed but its RadixCache does not import here ({e}); no SGLang column",
                   file=sys.stderr)
        return None


# -- measuring ------------------------------------------------------------------------------

def timed_us(fn) -> float:
    gc.disable()
    try:
        t = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t) / 1e3
    finally:
        gc.enable()


def deep_bytes(root) -> int:
    """Bytes of every object reachable from ``root`` (not types, modules or functions), each
    numpy array's data once, and each tensor's storage once."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, stack, total, storages = set(), [root], 0, {}
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, skip):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        elif isinstance(o, np.ndarray) and o.base is not None:
            stack.append(o.base)  # a view's data is its base's
        stack.extend(gc.get_referents(o))
    return total + sum(storages.values())


class Trees:
    """The trees under test, fed the same sequences: kvtier from tensors and from lists (above
    page 1 twice: checking every slot, and one a page), the token tree and SGLang's from lists."""

    def __init__(self, capacity: int, page_size: int, sglang=None):
        self.ps, self.rc = page_size, sglang
        forms = ("tensor", "list") + (("tensor_unchecked", "list_unchecked") if page_size > 1 else ())
        self.kv = {form: HiCache(MHATokenToKVPool(capacity, page_size, torch.float16, 1, 1, 1, "cpu"), None,
                                 CacheConfig(page_size=page_size, check_slots="unchecked" not in form))
                   for form in forms}
        self.ref = ReferenceRadixTree()
        self.sgl = sglang.RadixCache.create_simulated(page_size=page_size) if sglang is not None else None

    def names(self, op: str = "insert") -> list[str]:
        """The trees an operation is timed on (the unchecked caches differ only in inserts)."""
        kv = list(self.kv) if op != "match" else ["tensor", "list"]
        return kv + ["reference"] + (["sglang"] if self.sgl is not None else [])

    def _slots(self, cache: HiCache, tokens, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Slots for ``tokens`` as an engine has them: the match's, then new ones; (slots, the
        new ones, how many the match gave)."""
        m = cache.match_prefix(tokens, count=False)
        own = cache.alloc_device(-(-(n - m.device_len) // self.ps) * self.ps)
        assert own is not None, "bench pool too small"
        return torch.cat([m.device_indices, own[: n - m.device_len]]), own, m.device_len

    def insert(self, name: str, seq: np.ndarray, as_list: list[int]) -> tuple[float, int]:
        """Insert ``seq`` into one tree; (microseconds, tokens cached before)."""
        full, out = len(seq) // self.ps * self.ps, []
        if name in self.kv:
            cache = self.kv[name]
            tokens = as_list if name.startswith("list") else torch.from_numpy(seq)
            slots, own, matched = self._slots(cache, tokens, len(seq))
            us = timed_us(lambda: out.append(cache.insert(tokens, slots)))
            cache.free_device(own[full - matched :])  # a partial last page stays the caller's
            return us, out[0]
        slots = self.kv["list"].match_prefix(as_list, count=False).device_indices  # any slot values do
        values = torch.cat([slots, torch.arange(len(slots), full)])
        # The other trees keep the key they are given; kvtier keeps a copy of the caller's list (which the
        # caller may go on changing): each is timed from the engine's token list, making its key included.
        if name == "reference":
            vals = values.tolist()
            return timed_us(lambda: out.append(self.ref.insert(as_list[:full], vals))), out[0]
        return timed_us(lambda: out.append(self.sgl.insert(self.rc.RadixKey(as_list[:full]), values))), out[0]

    def undo(self, name: str, seq: np.ndarray, as_list: list[int], before: int) -> None:
        """Take out what :meth:`insert` of ``seq`` added (the leaf past ``before`` tokens)."""
        full = len(seq) // self.ps * self.ps
        if before >= full:
            return
        if name in self.kv:
            cache = self.kv[name]
            leaf = cache.match_prefix(as_list, count=False).node
            assert len(leaf) == full - before, "the insert's leaf"
            with cache._lock:
                cache.tiers.drop_subtree(leaf)
        elif name == "reference":
            self.ref.remove_leaf(as_list[:full], before)
        else:
            self.sgl._delete_leaf(self.sgl.match_prefix(self.rc.RadixKey(as_list[:full])).last_device_node)

    def match(self, name: str, seq: np.ndarray, as_list: list[int]) -> tuple[float, int]:
        """Match ``seq`` in one tree; (microseconds, tokens matched)."""
        out = []
        if name in self.kv:
            cache, tokens = self.kv[name], (as_list if name.startswith("list") else torch.from_numpy(seq))
            us = timed_us(lambda: out.append(cache.match_prefix(tokens).device_len))
        elif name == "reference":
            us = timed_us(lambda: out.append(len(self.ref.match(as_list)) // self.ps * self.ps))
        else:
            key = self.rc.RadixKey(as_list)
            us = timed_us(lambda: out.append(len(self.sgl.match_prefix(key).device_indices)))
        return us, out[0]

    def bytes_per_token(self, cached: int) -> dict[str, float]:
        roots = {"tensor": self.kv["tensor"].tree, "list": self.kv["list"].tree, "reference": self.ref.root}
        if self.sgl is not None:
            roots["sglang"] = self.sgl.root_node
        return {name: deep_bytes(root) / cached for name, root in roots.items()}


@dataclass(frozen=True)
class Row:
    cached_tokens: int
    page_size: int
    prompt_tokens: int
    hit_tokens: int
    matched_tokens: int
    match_us: float
    match_list_us: float
    reference_match_us: float
    sglang_match_us: float | None
    insert_us: float
    insert_list_us: float
    reference_insert_us: float
    sglang_insert_us: float | None
    insert_hit_us: float
    insert_hit_list_us: float
    reference_insert_hit_us: float
    sglang_insert_hit_us: float | None
    insert_unchecked_us: float | None
    insert_unchecked_list_us: float | None
    insert_hit_unchecked_us: float | None
    insert_hit_unchecked_list_us: float | None
    bytes_per_token: float | None
    tensor_bytes_per_token: float | None
    reference_bytes_per_token: float | None
    sglang_bytes_per_token: float | None


class Workload:
    """Conversations sharing a system prompt, fed to every tree."""

    def __init__(self, trees: Trees, prompt: int, hit: int, system: int, seed: int):
        self.trees, self.prompt, self.hit = trees, prompt, hit
        self.rng = np.random.default_rng(seed)
        self.system = self.fresh(system)
        self.seqs: list[np.ndarray] = []
        self.cached = 0

    def fresh(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n)

    def conversation(self) -> np.ndarray:
        """The system prompt and fresh tokens, or a random earlier conversation continued from a
        random page boundary past its system prompt."""
        if not self.seqs:
            return np.concatenate([self.system, self.fresh(self.prompt - len(self.system))])
        src = self.seqs[self.rng.integers(len(self.seqs))]
        ps = self.trees.ps
        shared = int(self.rng.integers(len(self.system) // ps, len(src) // ps + 1)) * ps
        return np.concatenate([src[:shared], self.fresh(self.prompt - shared)])

    def grow_to(self, tokens: int, bar) -> None:
        while self.cached < tokens:
            seq = self.conversation()
            as_list = seq.tolist()
            befores = {name: self.trees.insert(name, seq, as_list)[1] for name in self.trees.names()}
            assert len(set(befores.values())) == 1, f"the trees disagree on what was cached: {befores}"
            added = len(seq) // self.trees.ps * self.trees.ps - befores["list"]
            self.seqs.append(seq)
            self.cached += added
            bar.update(added)

    def probes(self) -> dict[str, np.ndarray]:
        """The match's prompt (its first ``hit`` tokens a cached conversation's; inserted as
        ``insert_hit``), and a new prompt (``insert``: the system prompt and fresh tokens)."""
        src = [s for s in self.seqs if len(s) >= self.hit]
        base = src[int(self.rng.integers(len(src)))]
        hit = np.concatenate([base[: self.hit], self.fresh(self.prompt - self.hit)])
        return {"match": hit, "insert_hit": hit,
                "insert": np.concatenate([self.system, self.fresh(self.prompt - len(self.system))])}


def measure(w: Workload, repeats: int, memory: bool) -> Row:
    """Every operation on every tree at the workload's current size, each tree in turn."""
    trees, probes = w.trees, w.probes()
    times: dict[tuple[str, str], list[float]] = {}
    matched = {}
    for op in OPS:
        seq = probes[op]
        as_list = seq.tolist()
        for r in range(repeats + 1):  # the first is a warm-up (a match may split a node once)
            for name in trees.names(op):
                if op == "match":
                    us, matched[name] = trees.match(name, seq, as_list)
                else:
                    us, before = trees.insert(name, seq, as_list)
                    trees.undo(name, seq, as_list, before)
                if r:
                    times.setdefault((op, name), []).append(us)
    assert len(set(matched.values())) == 1, f"the trees disagree on the match: {matched}"
    med = {k: statistics.median(v) for k, v in times.items()}
    cols = {}
    for op in OPS:
        for field, name in zip(COLUMNS[op], TREES):
            cols[field] = med.get((op, name))
        for field, name in zip(UNCHECKED.get(op, ()), ("tensor_unchecked", "list_unchecked")):
            cols[field] = med.get((op, name))
    mem = trees.bytes_per_token(w.cached) if memory else {}
    return Row(cached_tokens=w.cached, page_size=trees.ps, prompt_tokens=w.prompt, hit_tokens=w.hit,
               matched_tokens=matched["list"], **cols, bytes_per_token=mem.get("list"),
               tensor_bytes_per_token=mem.get("tensor"), reference_bytes_per_token=mem.get("reference"),
               sglang_bytes_per_token=mem.get("sglang"))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:>7.1f}x" if a is not None and b else f"{'-':>8}"


def print_table(rows: list[Row], echo=click.echo) -> None:
    head = (f"{'page':>4} {'cached':>9} {'operation':<10} {'tensor us':>10} {'list us':>9} {'tree us':>9} "
            f"{'SGLang us':>9} {'tree/list':>9} {'SGL/list':>8} {'SGL/tensor':>10}")
    echo(head)
    echo("-" * len(head))
    for r in rows:
        for op in OPS:
            t, li, ref, sgl = (getattr(r, f) for f in COLUMNS[op])
            sgl_txt = f"{sgl:>9.0f}" if sgl is not None else f"{'-':>9}"
            echo(f"{r.page_size:>4} {r.cached_tokens:>9} {op:<10} {t:>10.0f} {li:>9.0f} {ref:>9.0f} {sgl_txt} "
                 f"{_ratio(ref, li):>9} {_ratio(sgl, li)} {_ratio(sgl, t):>10}")
            if op in UNCHECKED and getattr(r, UNCHECKED[op][0]) is not None:
                t, li = (getattr(r, f) for f in UNCHECKED[op])
                echo(f"{'':>14} {'  unchecked':<10} {t:>10.0f} {li:>9.0f} {'':>9} {'':>9} {'':>9} "
                     f"{_ratio(sgl, li)} {_ratio(sgl, t):>10}")
    for r in rows:
        if r.bytes_per_token is not None:
            sgl = f", SGLang {r.sglang_bytes_per_token:.1f}" if r.sglang_bytes_per_token is not None else ""
            echo(f"bytes per cached token, page {r.page_size}, {r.cached_tokens} cached: kvtier {r.bytes_per_token:.1f} "
                 f"(fed lists), {r.tensor_bytes_per_token:.1f} (fed tensors); token tree "
                 f"{r.reference_bytes_per_token:.1f}{sgl}")


def verdict(rows: list[Row], echo=click.echo) -> None:
    """How many times kvtier is at or below SGLang (each operation, list and tensor)."""
    pairs = [(getattr(r, COLUMNS[op][i]), getattr(r, COLUMNS[op][3])) for r in rows for op in OPS for i in (0, 1)]
    pairs = [(k, s) for k, s in pairs if s is not None]
    if pairs:
        echo(f"\nkvtier at or below SGLang's RadixCache: {sum(k <= s for k, s in pairs)} of {len(pairs)} "
             "(operation x page size x size x list/tensor)")
    best = [(min(getattr(r, COLUMNS[op][i]), getattr(r, UNCHECKED[op][i]) or float("inf")), getattr(r, COLUMNS[op][3]))
            for r in rows for op in UNCHECKED for i in (0, 1) if getattr(r, COLUMNS[op][3]) is not None]
    if best and any(getattr(r, UNCHECKED["insert"][0]) is not None for r in rows):
        echo(f"inserts at or below SGLang's with check_slots=False above page 1: {sum(k <= s for k, s in best)} of "
             f"{len(best)}")
    mem = [(r.bytes_per_token, r.sglang_bytes_per_token) for r in rows if r.sglang_bytes_per_token is not None]
    if mem:
        echo(f"bytes per cached token at or below SGLang's (fed lists): {sum(k <= s for k, s in mem)} of {len(mem)}")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not comma-separated integers, e.g. 100000,1000000", param_hint=flag) from None


@click.command("cache")
@click.option("--sizes", default="100000,1000000", show_default=True, help="Cached-token counts to grow through.")
@click.option("--page-size", "page_sizes", multiple=True, type=click.IntRange(min=1), default=(1, 64),
              show_default=True, help="Repeatable.")
@click.option("--prompt", "--prompts", "prompt", default=32768, show_default=True, type=click.IntRange(min=1),
              help="Tokens a prompt.")
@click.option("--hit", type=click.IntRange(min=0), help="Tokens of the matched prompt that are cached "
              "[default: 3/4 of --prompt, whole pages]")
@click.option("--system", type=click.IntRange(min=0), help="Tokens of the system prompt every conversation starts "
              "with [default: 1/32 of --prompt, whole pages]")
@click.option("--repeats", default=15, show_default=True, type=click.IntRange(min=1),
              help="Timed calls per cell, median (15: every cell at or below SGLang's in 8 runs of 9; 7: in 6 of 8; "
                   "2-core CPU).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--memory/--no-memory", default=True, show_default=True, help="Bytes per cached token of each tree.")
@click.option("--sglang/--no-sglang", default=True, show_default=True,
              help="SGLang's RadixCache as a column where sglang is installed.")
@click.option("--budget-us", default=200.0, show_default=True, type=FINITE_POSITIVE,
              help="Acceptance: kvtier's match from a tensor at the largest size, each page size.")
@click.option("--json", "json_path", type=JSON_PATH, help=JSON_HELP)
def cache(sizes, page_sizes, prompt, hit, system, repeats, seed, memory, sglang, budget_us, json_path):
    """Prefix-cache match and insert, from lists and tensors, vs a token-by-token tree and SGLang's."""
    sizes_l = sorted(_int_list(sizes, "--sizes"))
    page = max(page_sizes)
    hit = max(prompt * 3 // 4 // page * page, page) if hit is None else hit
    system = prompt // 32 // page * page if system is None else system
    if min(sizes_l) <= 0:
        raise click.BadParameter(f"sizes must be positive, got {min(sizes_l)}", param_hint="--sizes")
    if prompt < page:
        raise click.BadParameter(f"a prompt of {prompt} tokens is shorter than a page (--page-size {page}); give "
                                 "prompts of at least one page", param_hint="--prompt")
    if not system < hit <= prompt or system % page:
        raise click.BadParameter(f"need --system < --hit <= --prompt, --system whole pages of {page}; got {system}, "
                                 f"{hit}, {prompt}", param_hint="--hit")
    capacity = max(sizes_l) + 4 * prompt
    try:
        Trees(capacity // page * page + page, page)  # refused by the pool's check before anything is allocated
    except MemoryError as e:
        need = str(e).split(". Lower")[0]  # the pool's own fix names its constructor's argument
        raise click.UsageError(f"--sizes up to {max(sizes_l):,} and --prompt {prompt:,} need a pool of {capacity:,} "
                               f"token slots: {need}. Lower --sizes.") from None
    rc = load_sglang() if sglang else None
    rows: list[Row] = []
    for ps in page_sizes:
        w = Workload(Trees(capacity // ps * ps + ps, ps, rc), prompt, hit, system, seed)
        with tqdm(total=max(sizes_l), desc=f"page {ps}: growing the trees", unit="tok", leave=False) as bar:
            for size in sizes_l:
                w.grow_to(size, bar)
                rows.append(measure(w, repeats, memory))
    echo = echo_for(json_path)
    print_table(rows, echo)
    verdict(rows, echo)
    for ps in page_sizes:
        last = max((r for r in rows if r.page_size == ps), key=lambda r: r.cached_tokens)
        ok = last.match_us <= budget_us
        echo(f"match from a tensor, page {ps}, {last.cached_tokens} tokens cached: {last.match_us:.1f} us "
             f"(budget {budget_us:.0f} us) -> {'PASS' if ok else 'FAIL'}")
    if json_path:
        write_json(json_path, [asdict(r) for r in rows], indent=1)
