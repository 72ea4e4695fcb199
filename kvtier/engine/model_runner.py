"""Turns a scheduled :class:`Batch` into tensors, runs the model, picks tokens greedily."""

from __future__ import annotations

import torch

from .attention import AttentionBatch, SeqSlice
from .scheduler import Batch


class ModelRunner:
    """Owns the model and the device pool; the only part of the engine that touches tensors."""

    def __init__(self, model, pool, inputs: str = "sms"):
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.inputs = inputs  # EngineConfig.inputs

    def _tensor(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda" or self.inputs == "pageable":
            return t.to(self.device, non_blocking=True)
        if self.inputs == "pinned":
            return t.pin_memory().to(self.device, non_blocking=True)
        # Read over PCIe by SMs, not queued on a copy engine: a host-tier hit's load queues
        # gigabytes of host -> device copies just before this step, and inputs copied behind
        # them wait for up to DMAConfig.load_drain layers of it to land.
        from ..transfer.cuda_common import on_device
        return on_device(t, self.device)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        new_slots: list[int] = []
        seqs: list[SeqSlice] = []
        for seq in batch.seqs:
            start, end = seq.num_computed, seq.num_tokens
            seqs.append(SeqSlice(len(ids), start, end - start, self._tensor(seq.slots[:end]), seq.layer_load))
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            new_slots += seq.slots[start:end]
        last_rows = [s.offset + s.n_new - 1 for s in seqs]
        attn = AttentionBatch(seqs, self._tensor(new_slots))
        return self._tensor(ids), self._tensor(positions), attn, self._tensor(last_rows)

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        """Feed every sequence's new tokens; return each one's greedy next token."""
        ids, positions, attn, last_rows = self.prepare(batch)
        logits = self.model(ids, positions, attn, self.pool, last_rows)
        return logits.argmax(dim=-1).tolist()
