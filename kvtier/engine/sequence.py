"""A request as the scheduler sees it: token ids, progress, and its slots (all ints)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation request.

    ``token_ids`` is the prompt followed by the tokens generated so far.
    ``slots[j]`` is the device slot of token ``j`` (whole pages are held, so
    ``len(slots)`` is a page multiple >= the tokens with KV). The first
    ``prefix_len`` slots belong to the prefix cache (locked through ``node``);
    the rest belong to this sequence. ``num_computed`` tokens have their KV in
    the pool; the next forward pass feeds ``token_ids[num_computed:]``.
    """

    token_ids: list[int]
    max_new_tokens: int
    namespace: str = "default"
    req_id: int = field(default_factory=lambda: next(_ids))
    num_prompt: int = 0
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    # KV bookkeeping, owned by the KV manager
    slots: list[int] = field(default_factory=list)
    prefix_len: int = 0
    num_computed: int = 0
    node: object | None = None
    layer_load: object | None = None
    # accounting
    reused_device: int = 0  # prompt tokens found on the device at first admission
    reused_host: int = 0    # ... and loaded from the host tier
    reused_storage: int = 0  # ... and loaded from the storage tier (through the host)
    reused_on_resume: int = 0  # tokens reused (either tier) when resuming after preemption
    computed: int = 0  # tokens prefilled (not reused), resumes included
    preemptions: int = 0
    load_failed: bool = False  # a load of its prefix failed: it is computed in full

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt = self.num_prompt or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_new(self) -> int:
        """Tokens the next forward pass feeds (the uncached prompt, or one decode token)."""
        return self.num_tokens - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens

    def count_reuse(self, device: int, host: int, storage: int = 0) -> None:
        if self.preemptions:
            self.reused_on_resume += device + host + storage
        else:
            self.reused_device, self.reused_host, self.reused_storage = device, host, storage

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival
