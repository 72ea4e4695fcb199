"""A synthetic multi-turn chat workload, shaped like SGLang's multi-turn benchmark.

``clients`` conversations run at once. Every conversation starts with the
same system prompt; each round a client sends its whole history (system
prompt, earlier user turns and the model's answers) plus a new user turn,
and sends the next round as soon as the answer is complete. Token ids are
drawn from ``seed``, so every run of a workload sends the same prompts as
long as the model answers the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from .engine import Engine
from .sequence import Sequence
from ..validate import require_positive_int


@dataclass(frozen=True)
class Workload:
    clients: int = 8
    rounds: int = 6
    system_tokens: int = 512
    user_tokens: int = 128
    output_tokens: int = 32
    vocab_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("clients", "rounds", "user_tokens", "output_tokens", "vocab_size"):
            require_positive_int(f, getattr(self, f))
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")

    def _tokens(self, n: int, *key: int) -> list[int]:
        rng = random.Random(hash((self.seed,) + key))
        return [rng.randrange(self.vocab_size) for _ in range(n)]

    def system_prompt(self) -> list[int]:
        return self._tokens(self.system_tokens, -1)

    def user_turn(self, client: int, round_: int) -> list[int]:
        return self._tokens(self.user_tokens, client, round_)

    def prompt(self, client: int, round_: int, outputs: dict[tuple[int, int], list[int]]) -> list[int]:
        """``client``'s prompt in round ``round_``, given the model's answers of its earlier rounds
        (``outputs[(client, round)]``)."""
        tokens = self.system_prompt()
        for r in range(round_):
            tokens = tokens + self.user_turn(client, r) + outputs[(client, r)]
        return tokens + self.user_turn(client, round_)

    def longest_prompt(self) -> int:
        return self.system_tokens + self.rounds * self.user_tokens + (self.rounds - 1) * self.output_tokens

    def total_turns(self) -> int:
        return self.clients * self.rounds


@dataclass
class Turn:
    """What one request of the workload saw."""

    client: int
    round: int
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    outputs: list[int]
    reused_device: int
    reused_host: int
    reused_on_resume: int
    computed: int
    preemptions: int
    reused_storage: int = 0


@dataclass
class WorkloadResult:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        return {(t.client, t.round): t.outputs for t in self.turns}


def run_workload(engine: Engine, wl: Workload, on_turn: Callable[[Turn], None] | None = None) -> WorkloadResult:
    """Serve ``wl`` on ``engine`` to the end; ``on_turn`` is called as each request finishes."""
    import time

    result = WorkloadResult()
    system = wl.system_prompt()
    owner: dict[int, tuple[int, int]] = {}

    def submit(client: int, round_: int, history: list[int]) -> None:
        seq = engine.add_request(history + wl.user_turn(client, round_), wl.output_tokens)
        owner[seq.req_id] = (client, round_)

    start = time.perf_counter()
    for c in range(wl.clients):
        submit(c, 0, system)
    while engine.has_work():
        for seq in engine.step():
            client, round_ = owner.pop(seq.req_id)
            turn = _turn(client, round_, seq)
            result.turns.append(turn)
            if on_turn:
                on_turn(turn)
            if round_ + 1 < wl.rounds:
                submit(client, round_ + 1, seq.token_ids)
    result.wall_s = time.perf_counter() - start
    return result


def run_requests(engine: Engine, prompts: dict[tuple[int, int], list[int]], output_tokens: int,
                 on_turn: Callable[[Turn], None] | None = None) -> WorkloadResult:
    """Serve ``prompts`` (by ``(client, round)``), all sent at once, to the end."""
    import time

    result = WorkloadResult()
    start = time.perf_counter()
    owner = {engine.add_request(p, output_tokens).req_id: key for key, p in prompts.items()}
    while engine.has_work():
        for seq in engine.step():
            turn = _turn(*owner.pop(seq.req_id), seq)
            result.turns.append(turn)
            if on_turn:
                on_turn(turn)
    result.wall_s = time.perf_counter() - start
    return result


def _turn(client: int, round_: int, seq: Sequence) -> Turn:
    return Turn(
        client, round_, seq.num_prompt, seq.ttft, seq.finished_at - seq.arrival, seq.output_ids,
        seq.reused_device, seq.reused_host, seq.reused_on_resume, seq.computed, seq.preemptions, seq.reused_storage,
    )
