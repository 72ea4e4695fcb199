"""Host memory: how much we may take, and making it visible to the GPU."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

GB = 1e9
# Left to the rest of the process and the machine unless told otherwise
# (the seed keeps 10 GiB; so do we, overridable per pool or by environment).
DEFAULT_RESERVE_BYTES = 10 * (1 << 30)
RESERVE_ENV = "KVTIER_HOST_RESERVE_GB"

CGROUP_V2 = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current"))
CGROUP_V1 = (
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


@dataclass(frozen=True)
class HostMemory:
    """What a new host pool may take, after the reserve."""

    available: int          # min(host, cgroup), bytes
    host_available: int     # psutil's available minus reserve
    cgroup_available: int | None
    cgroup_limit: int | None
    reserve: int
    total: int


def default_reserve_bytes() -> int:
    raw = os.environ.get(RESERVE_ENV)
    if raw is None:
        return DEFAULT_RESERVE_BYTES
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{RESERVE_ENV}={raw!r} is not a number of GB") from None
    if value < 0:
        raise ValueError(f"{RESERVE_ENV}={raw!r} must be >= 0")
    return int(value * GB)


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


def cgroup_limit_and_usage(
    v2: tuple[Path, Path] = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1
) -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup when it constrains us, else None."""
    for limit_path, usage_path in (v2, v1):
        limit, usage = _read_bytes(limit_path), _read_bytes(usage_path)
        if limit is not None and usage is not None:
            if limit >= psutil.virtual_memory().total:
                return None
            return limit, usage
    return None


def host_memory(reserve_bytes: int | None = None) -> HostMemory:
    reserve = default_reserve_bytes() if reserve_bytes is None else int(reserve_bytes)
    if reserve < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes!r}")
    vm = psutil.virtual_memory()
    host = max(vm.available - reserve, 0)
    cg = cgroup_limit_and_usage()
    if cg is None:
        return HostMemory(host, host, None, None, reserve, vm.total)
    limit, usage = cg
    cg_avail = max(limit - usage - reserve, 0)
    return HostMemory(min(host, cg_avail), host, cg_avail, limit, reserve, vm.total)


POOL_FIX = (f"Shrink the pool (host_size_tokens, host_size in GB, or host_to_device_ratio) or lower the reserve "
            f"(reserve_bytes=..., or {RESERVE_ENV}).")


def check_host_memory(requested: int, reserve_bytes: int | None, what: str, fix: str = POOL_FIX) -> HostMemory:
    """Raise MemoryError, before anything is allocated, if ``requested`` will not fit; the
    message names ``what``, the sizes, and ``fix`` (default: how to shrink a pool)."""
    mem = host_memory(reserve_bytes)
    if requested > mem.available:
        where = "host" if mem.cgroup_available is None or mem.host_available <= mem.cgroup_available else "cgroup"
        raise MemoryError(
            f"{what} needs {requested / GB:.2f} GB of host memory but only "
            f"{mem.available / GB:.2f} GB is available ({where} limit, after keeping "
            f"{mem.reserve / GB:.2f} GB in reserve). {fix}"
        )
    return mem


def gpu_available() -> bool:
    return torch.cuda.is_available()


class HostBuffer:
    """A host tensor, pinned and mapped for the GPU when CUDA is present.

    Pinning is done by registering ordinary pageable memory (no power-of-two
    rounding as with the caching host allocator); it is unregistered when the
    owner is garbage-collected or :meth:`release` is called.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool | None = None):
        self.tensor = torch.empty(shape, dtype=dtype, device="cpu")
        want = gpu_available() if pin is None else pin
        if want and not gpu_available():
            raise RuntimeError("pin=True needs CUDA; CPU-only torch cannot pin memory")
        self.pinned = False
        if want and self.tensor.numel():
            _register(self.tensor)
            self.pinned = True
            self._finalizer = weakref.finalize(self, _unregister, self.tensor)

    def release(self) -> None:
        if self.pinned:
            self._finalizer()
            self.pinned = False


# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may use it,
# and kernels may read it through its (UVA) host address.
_REGISTER_FLAGS = 1 | 2


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), _REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)} for {t.nbytes / GB:.2f} GB")


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
