"""Host memory: how much we may take, and making it visible to the GPU."""

from __future__ import annotations

import math
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from .validate import is_finite_number

GB = 1e9
# Left to the rest of the process and the machine unless told otherwise
# (the seed keeps 10 GiB; so do we, overridable per pool or by environment).
DEFAULT_RESERVE_BYTES = 10 * (1 << 30)
RESERVE_ENV = "KVTIER_HOST_RESERVE_GB"
# The host memory this process may use, where the OS reports less than the machine can take.
LIMIT_ENV = "KVTIER_HOST_LIMIT_GB"
# The most GB a size in bytes may name (an int64 of bytes): more is no machine's memory.
MAX_GB = (2**63 - 1) / GB
# Host memory a pool keeps per layer and component beyond its KV bytes: tensor views, pointer
# table entries, transfer parts (1.2-1.9 KB measured, torch 2.13 on the CPU). A model of a
# million layers and a few MB of KV needs GBs of them.
LAYER_OBJECT_BYTES = 2048

# Where the cgroup file systems are mounted, and which cgroups this process is in.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# (limit file, usage file, memory.stat key of the reclaimable page cache) per cgroup version.
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


@dataclass(frozen=True)
class HostMemory:
    """What a new host pool may take, after the reserve."""

    available: int          # min(host, cgroup), bytes
    host_available: int     # psutil's available (or the operator's limit less this process's use) minus reserve
    cgroup_available: int | None
    cgroup_limit: int | None
    reserve: int
    total: int
    limit: int | None = None  # KVTIER_HOST_LIMIT_GB, bytes, where set
    cgroup_path: str | None = None  # the cgroup directory whose limit counts, where one does
    promised: int = 0       # live host pools' bytes not in memory yet (taken out of the figures above)


class HostMemoryError(MemoryError, ValueError):
    """Not enough host memory for what was asked, found before anything is allocated. Also a
    ``ValueError``: the seed raised that for a host pool too large, and engines written
    against it catch it to retry with a smaller pool."""


class EnvSettingError(ValueError):
    """A ``KVTIER_*`` environment variable holds a value kvtier cannot use (the CLI reports it
    as a usage error, naming the variable)."""


def _env_gb(name: str, positive: bool) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise EnvSettingError(f"{name}={raw!r} is not a number of GB") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise EnvSettingError(f"{name}={raw!r} must be {'> 0' if positive else '>= 0'} (GB)")
    if value > MAX_GB:
        raise EnvSettingError(f"{name}={raw!r} is more memory than a machine has; give at most {MAX_GB:.3g} (GB)")
    return value


def layer_objects_bytes(layer_num: int, components: int) -> int:
    """Host memory the per-layer objects of a pool of ``layer_num`` layers and ``components``
    components take (:data:`LAYER_OBJECT_BYTES` each), to count with its KV bytes."""
    return layer_num * components * LAYER_OBJECT_BYTES


def default_reserve_bytes() -> int:
    value = _env_gb(RESERVE_ENV, positive=False)
    return DEFAULT_RESERVE_BYTES if value is None else int(value * GB)


def host_limit_bytes() -> int | None:
    """``KVTIER_HOST_LIMIT_GB`` in bytes, or None where unset: the host memory this process
    may use, for machines whose OS reports far less available than they can take (a VM whose
    memory grows as it is used, such as a balloon or Firecracker, reads a small MemAvailable
    until its memory has been touched, and gives it back when freed). Raises
    :class:`EnvSettingError` for a value that is not a number above 0."""
    value = _env_gb(LIMIT_ENV, positive=True)
    return None if value is None else int(value * GB)


def _read_bytes(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if not raw or raw == "max":
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge page-aligned number.
    return value if 0 < value < (1 << 60) else None


def _own_cgroups(root: Path, proc: Path) -> list[tuple[Path, Path, tuple[str, str, str]]]:
    """(directory, its mount's root, file names) of this process's memory cgroup under each
    version, from ``proc`` (``/proc/self/cgroup``): cgroup v2's unified path under ``root``, and
    v1's memory controller path under ``root/memory``. Where ``proc`` cannot be read, the mounts'
    roots (as inside a container with its own cgroup namespace)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        lines = []
    v2 = v1 = "/"
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return [(_under(root, v2), root, _V2), (_under(root / "memory", v1), root / "memory", _V1)]


def _under(base: Path, path: str) -> Path:
    """``base`` joined with a cgroup path; the base itself for a path that leaves it (a process
    outside its namespace's root sees ``/..``)."""
    parts = [p for p in path.split("/") if p and p != "."]
    return base if ".." in parts else base.joinpath(*parts)


def _page_cache(stat: Path, key: str) -> int:
    """The reclaimable page cache ``key`` (bytes) in a cgroup's ``memory.stat``, 0 if absent."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class CgroupRoom(tuple):
    """``(limit, usage)`` of a cgroup level, with the level's directory as ``path``."""

    def __new__(cls, limit: int, usage: int, path: str):
        room = super().__new__(cls, (limit, usage))
        room.path = path
        return room


def cgroup_limit_and_usage(root: Path | None = None, proc: Path | None = None) -> CgroupRoom | None:
    """(limit, usage) of the memory cgroup that leaves this process the least room, else None.

    Every level from this process's own cgroup up to the mount's root counts (a parent's limit
    caps its children's usage together), under cgroup v2 and v1 alike. Usage leaves out the
    inactive page cache (``memory.stat``), which the kernel reclaims before it runs out, as
    container runtimes count a working set. Under v2 a level's limit is the lower of
    ``memory.max`` and ``memory.high``. Levels with no limit, or one at or above the machine's
    memory, are passed over.
    """
    root = CGROUP_ROOT if root is None else root
    proc = PROC_CGROUP if proc is None else proc
    total = psutil.virtual_memory().total
    best = None
    for leaf, base, names in _own_cgroups(root, proc):
        limit_name, usage_name, cache_key = names
        d = leaf
        while True:
            limit, usage = _read_bytes(d / limit_name), _read_bytes(d / usage_name)
            if names is _V2 and (high := _read_bytes(d / "memory.high")) is not None:
                # Above memory.high the kernel throttles and reclaims hard, and pinned pages
                # cannot be reclaimed: it is the limit a pool should stay under.
                limit = high if limit is None else min(limit, high)
            if limit is not None and usage is not None and limit < total:
                usage = max(usage - _page_cache(d / "memory.stat", cache_key), 0)
                if best is None or limit - usage < best[0] - best[1]:
                    best = CgroupRoom(limit, usage, str(d))
            if d == base or d.parent == d:
                break
            d = d.parent
    return best


def host_memory(reserve_bytes: int | None = None) -> HostMemory:
    if reserve_bytes is not None and not is_finite_number(reserve_bytes):
        raise ValueError(f"reserve_bytes must be a finite number of bytes >= 0, got {reserve_bytes!r}")
    reserve = default_reserve_bytes() if reserve_bytes is None else int(reserve_bytes)
    vm = psutil.virtual_memory()
    own = host_limit_bytes()
    # With a limit set, what this process holds now (pinned pools are resident) counts
    # against it, in place of what the OS says the machine has free.
    free = vm.available if own is None else own - psutil.Process().memory_info().rss
    # Pools already made whose pages are not in memory yet (pageable memory is taken as it is
    # first written; pinned memory is resident) will take them: neither figure shows them.
    promised = promised_bytes()
    host = max(free - promised - reserve, 0)
    cg = cgroup_limit_and_usage()
    if cg is None:
        return HostMemory(host, host, None, None, reserve, vm.total, own, None, promised)
    limit, usage = cg
    cg_avail = max(limit - usage - promised - reserve, 0)
    return HostMemory(min(host, cg_avail), host, cg_avail, limit, reserve, vm.total, own, getattr(cg, "path", None),
                      promised)


# Every live HostBuffer: what pools made so far have been promised (promised_bytes).
_BUFFERS: "weakref.WeakSet[HostBuffer]" = weakref.WeakSet()


def promised_bytes() -> int:
    """Bytes of live host buffers (every host pool's) that no memory backs yet: a pageable
    buffer is backed as it is first written, so a second pool checked against what the OS
    reports free would be let take the same memory as the first (CPU-only torch pins nothing).
    0 where residency cannot be read."""
    total = 0
    for b in list(_BUFFERS):
        t = b.tensor
        n = t.numel() * t.element_size()
        if n and not b.pinned:
            held = resident_bytes(t)
            total += 0 if held is None else max(n - held, 0)
    return total


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s memory in RAM now, by ``mincore`` (a byte per page, read in one call);
    None where that cannot be read."""
    import ctypes

    n = t.numel() * t.element_size()
    if not n:
        return 0
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + n - lo) // page)
    vec = (ctypes.c_ubyte * pages)()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * page), vec) != 0:
            return None
    except (OSError, AttributeError):
        return None
    import numpy as np
    resident = int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
    return min(resident * page, n)


POOL_FIX = (f"Shrink the pool (host_size_tokens, host_size in GB, or host_to_device_ratio) or lower the reserve "
            f"(reserve_bytes=..., or {RESERVE_ENV}); where the OS reports less memory than the machine can take "
            f"(a VM whose memory grows as it is used), set {LIMIT_ENV} to what this process may use.")


def check_host_memory(requested: int, reserve_bytes: int | None, what: str, fix: str = POOL_FIX) -> HostMemory:
    """Raise :class:`HostMemoryError`, before anything is allocated, if ``requested`` will not fit; the
    message names ``what``, the sizes, and ``fix`` (default: how to shrink a pool)."""
    mem = host_memory(reserve_bytes)
    if requested > mem.available:
        where = "host limit" if mem.cgroup_available is None or mem.host_available <= mem.cgroup_available else "cgroup limit"
        if where == "host limit" and mem.limit is not None:
            where = f"{LIMIT_ENV}={mem.limit / GB:g} less this process's resident memory"
        elif where == "cgroup limit" and mem.cgroup_path:
            where = f"cgroup limit {mem.cgroup_limit / GB:.2f} GB at {mem.cgroup_path}"
        raise HostMemoryError(
            f"{what} needs {requested / GB:.2f} GB of host memory but only "
            f"{mem.available / GB:.2f} GB is available ({where}, after keeping "
            f"{mem.reserve / GB:.2f} GB in reserve). {fix}"
        )
    return mem


def gpu_available() -> bool:
    return torch.cuda.is_available()


HUGE_PAGES_ENV = "KVTIER_HOST_HUGE_PAGES"
HUGE_PAGE = 2 << 20


HUGE_PAGES_SUPPORTED = hasattr(mmap, "MADV_HUGEPAGE")  # Linux


def huge_pages_default() -> bool:
    """Whether host buffers ask for huge pages when their owner does not say:
    ``KVTIER_HOST_HUGE_PAGES`` (1 or 0), else wherever the platform can ask (Linux). Raises
    :class:`EnvSettingError` for another value, or for 1 where the platform cannot ask.

    From 2 MiB pages the zero-copy kernel moves scattered host pages 0.02-0.045x of the link
    faster than from 4 KiB ones; the copy engines do not gain. (Measured on an H200;
    docs/configuration.md, 'Where each default comes from'.)"""
    raw = os.environ.get(HUGE_PAGES_ENV, "").strip()
    if raw == "":
        return HUGE_PAGES_SUPPORTED
    if raw == "0":
        return False
    if raw == "1":
        if not HUGE_PAGES_SUPPORTED:
            raise EnvSettingError(f"{HUGE_PAGES_ENV}=1 but this platform cannot ask for huge pages (no MADV_HUGEPAGE); "
                             "set it to 0")
        return True
    raise EnvSettingError(f"{HUGE_PAGES_ENV}={raw!r} must be 1 (ask for huge pages) or 0 (do not)")


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page setting (``always``, ``madvise`` or ``never``: the
    bracketed word of ``path``); None where it cannot be read (not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_note(mode: str | None = None, *, read: bool = True) -> str:
    """One line for operators: whether host pools ask for huge pages here, and whether they
    can get them (``mode``: the transparent-huge-page setting; None reads it, unless ``read``
    is False: unknown)."""
    mode = thp_mode() if mode is None and read else mode
    if not huge_pages_default():
        why = f"{HUGE_PAGES_ENV}=0" if HUGE_PAGES_SUPPORTED else "this platform cannot ask"
        return f"host pages: 4 KiB; pools do not ask for huge pages ({why})"
    if mode in ("always", "madvise"):
        return f"host pages: pools ask for 2 MiB pages (transparent huge pages: {mode} here)"
    return (f"host pages: pools ask for 2 MiB pages, but transparent huge pages are {mode or 'unknown'} here: "
            "4 KiB pages (the zero-copy kernel moves scattered pages 0.02-0.045x slower, measured on an H200)")


def resolve_huge_pages(huge_pages: bool | None) -> bool:
    """``huge_pages`` as given (True or False), or :func:`huge_pages_default` for None; raises,
    naming the value and the fix, for anything else or for True where the platform cannot ask."""
    huge = huge_pages_default() if huge_pages is None else huge_pages
    if not isinstance(huge, bool):
        raise ValueError(f"huge_pages must be True, False or None (the environment's {HUGE_PAGES_ENV}), "
                         f"got {huge_pages!r}")
    if huge and not HUGE_PAGES_SUPPORTED:
        raise ValueError("huge_pages=True but this platform cannot ask for huge pages (no MADV_HUGEPAGE); "
                         "pass huge_pages=False")
    return huge


def _advised(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty CPU tensor in its own anonymous mapping, starting on a 2 MiB boundary and
    advised ``MADV_HUGEPAGE``: where transparent huge pages are ``always`` or ``madvise``,
    the kernel backs it with 2 MiB pages as it is first touched (here: when it is pinned).
    The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-_address(m)) % HUGE_PAGE
    m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)


def _address(m: mmap.mmap) -> int:
    import ctypes
    c = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _smaps_fields(lo: int, hi: int):
    """``(field, line)`` of every field line of ``/proc/self/smaps`` in a mapping that overlaps
    the addresses ``lo .. hi - 1``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside:
                yield head, line


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory the kernel backs with transparent huge pages now (from
    ``/proc/self/smaps``: the ``AnonHugePages`` of the mappings it lies in); 0 where that
    cannot be read."""
    lo = t.data_ptr()
    try:
        return sum(int(line.split()[1]) * 1024 for head, line in _smaps_fields(lo, lo + t.numel() * t.element_size())
                   if head == "AnonHugePages:")
    except OSError:
        return 0


def vm_flags(at: int) -> list[str]:
    """The kernel's ``VmFlags`` of the mapping that holds address ``at`` (``hg``: advised for
    huge pages); empty where there is none."""
    for head, line in _smaps_fields(at, at + 1):
        if head == "VmFlags:":
            return line.split()[1:]
    return []


class HostBuffer:
    """A host tensor, pinned and mapped for the GPU when CUDA is present.

    Pinning is done by registering ordinary pageable memory (no power-of-two
    rounding as with the caching host allocator); it is unregistered when the
    owner is garbage-collected or :meth:`release` is called.
    ``huge_pages`` (default :func:`huge_pages_default`: yes on Linux): the memory lies in a
    mapping of its own advised for transparent huge pages (:func:`_advised`), so fewer, larger
    pages back it where the kernel's setting allows (``always`` or ``madvise``).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool | None = None,
                 huge_pages: bool | None = None):
        huge = resolve_huge_pages(huge_pages)
        want = _want_pin(pin)  # refused before anything is allocated
        self._hold(_advised(shape, dtype) if huge else torch.empty(shape, dtype=dtype, device="cpu"), huge, want)

    @classmethod
    def adopt(cls, tensor: torch.Tensor, pin: bool | None = None, huge_pages: bool = False) -> "HostBuffer":
        """A host tensor allocated elsewhere, registered for the GPU as :class:`HostBuffer` registers
        its own unless it is pinned already (its owner then keeps it so). ``huge_pages``: whether
        its memory was advised for them (as a HostBuffer's own, taken over, was)."""
        self = cls.__new__(cls)
        self._hold(tensor, huge_pages, _want_pin(pin))
        return self

    def _hold(self, tensor: torch.Tensor, huge: bool, want: bool) -> None:
        """Keep ``tensor`` (counted among the live buffers), registered for the GPU if ``want``,
        undone when this buffer is released or collected."""
        self.huge_pages, self.tensor, self.pinned = huge, tensor, False
        _BUFFERS.add(self)
        if want and tensor.is_pinned():
            self.pinned = True  # its owner's pinning: not this buffer's to undo
        elif want and tensor.numel():
            _register(tensor)
            self.pinned = True
            self._finalizer = weakref.finalize(self, _unregister, tensor)

    def release(self) -> None:
        if self.pinned and hasattr(self, "_finalizer"):
            self._finalizer()
            self.pinned = False


def _want_pin(pin: bool | None) -> bool:
    """Whether to pin: as asked, by default where CUDA is present (refused without it)."""
    want = gpu_available() if pin is None else pin
    if want and not gpu_available():
        raise RuntimeError("pin=True needs CUDA; CPU-only torch cannot pin memory")
    return bool(want)


# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may use it,
# and kernels may read it through its (UVA) host address.
_REGISTER_FLAGS = 1 | 2


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), _REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)} for {t.nbytes / GB:.2f} GB")


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
