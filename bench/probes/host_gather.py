"""Probe: can CPU threads gather scattered host slots fast enough to feed the copy engine?

Host slots scattered one token at a time (page size 1) defeat the copy engine (one copy
per token and layer) and the zero-copy kernel tops out near 0.9x. The alternative: CPU
threads gather the scattered rows of a chunk into a pinned staging buffer while the copy
engine moves the previous chunk, one large copy each (and the reverse for backups: one
large copy into staging, then CPU threads scatter the rows into their slots).

Measures, for the llama-3-8b layer_first shape (2 KiB rows per token and layer, K and V),
32k scattered slots, with 1..N torch threads:
- the CPU gather alone (torch.index_select into pinned memory) and scatter alone (index_copy_);
- on CUDA: the pipelined load (gather chunk k+1 while chunk k copies) and backup, as GB/s and
  as a ratio to one contiguous pinned copy of the same bytes.
Usage: python bench/probes/host_gather.py OUT.json [--tokens N]
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

ROW = 2048          # one token's K (or V) of one layer, llama-3-8b
LAYERS = 32
MiB = 1 << 20


def timed(fn, reps=3):
    fn()
    ts = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(path, tokens=32768):
    cuda = torch.cuda.is_available()
    pin = cuda
    slots = 2 * tokens
    rng = np.random.default_rng(0)
    idx = torch.from_numpy(rng.permutation(slots)[:tokens].astype(np.int64))
    # One layer_first component: per layer, `slots` rows of ROW bytes.
    host = torch.empty((LAYERS, slots, ROW), dtype=torch.uint8, pin_memory=pin)
    host.view(-1)[:: 4096].fill_(1)
    nbytes = LAYERS * tokens * ROW
    chunk_rows = max(1, (64 * MiB) // ROW)
    out: dict = {"tokens": tokens, "bytes": nbytes, "cpu_threads_max": torch.get_num_threads()}
    staging = [torch.empty((chunk_rows, ROW), dtype=torch.uint8, pin_memory=pin) for _ in range(3)]

    def gather_all():
        for layer in range(LAYERS):
            for c0 in range(0, tokens, chunk_rows):
                sel = idx[c0:c0 + chunk_rows]
                torch.index_select(host[layer], 0, sel, out=staging[0][: len(sel)])

    def scatter_all():
        for layer in range(LAYERS):
            for c0 in range(0, tokens, chunk_rows):
                sel = idx[c0:c0 + chunk_rows]
                host[layer].index_copy_(0, sel, staging[0][: len(sel)])

    host_np, stg_np, idx_np = host.numpy(), staging[0].numpy(), idx.numpy()

    def split(pool, t, fn):
        """fn(lo, hi) over t slices of each chunk, on a thread pool (numpy releases the GIL)."""
        def run():
            for layer in range(LAYERS):
                for c0 in range(0, tokens, chunk_rows):
                    n = min(chunk_rows, tokens - c0)
                    bounds = np.linspace(0, n, t + 1).astype(int)
                    list(pool.map(lambda i: fn(layer, c0, bounds[i], bounds[i + 1]), range(t)))
        return run

    def np_gather(layer, c0, lo, hi):
        np.take(host_np[layer], idx_np[c0 + lo:c0 + hi], axis=0, out=stg_np[lo:hi])

    def np_scatter(layer, c0, lo, hi):
        host_np[layer][idx_np[c0 + lo:c0 + hi]] = stg_np[lo:hi]

    from concurrent.futures import ThreadPoolExecutor
    threads = [t for t in (1, 2, 4, 8, 16) if t <= max(1, torch.get_num_threads())]
    for t in threads:
        torch.set_num_threads(t)
        out[f"cpu_gather/threads{t}/gbps"] = round(nbytes / timed(gather_all) / 1e9, 2)
        out[f"cpu_scatter/threads{t}/gbps"] = round(nbytes / timed(scatter_all) / 1e9, 2)
        with ThreadPoolExecutor(t) as pool:
            out[f"numpy_gather/threads{t}/gbps"] = round(nbytes / timed(split(pool, t, np_gather)) / 1e9, 2)
            out[f"numpy_scatter/threads{t}/gbps"] = round(nbytes / timed(split(pool, t, np_scatter)) / 1e9, 2)
        print(t, {k: v for k, v in out.items() if f"threads{t}/" in k}, flush=True)
    if cuda:
        dev = torch.empty((LAYERS, tokens, ROW), dtype=torch.uint8, device="cuda")
        flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        out["limit_h2d_gbps"] = round(nbytes / timed(lambda: flat_dev.copy_(flat, non_blocking=True)) / 1e9, 2)
        out["limit_d2h_gbps"] = round(nbytes / timed(lambda: flat.copy_(flat_dev, non_blocking=True)) / 1e9, 2)
        stream = torch.cuda.Stream()
        done = [torch.cuda.Event() for _ in staging]

        def load():
            k = 0
            for layer in range(LAYERS):
                for c0 in range(0, tokens, chunk_rows):
                    sel = idx[c0:c0 + chunk_rows]
                    b = k % len(staging)
                    done[b].synchronize()  # its previous copy has left the buffer
                    torch.index_select(host[layer], 0, sel, out=staging[b][: len(sel)])
                    with torch.cuda.stream(stream):
                        dev[layer, c0:c0 + len(sel)].copy_(staging[b][: len(sel)], non_blocking=True)
                        done[b].record(stream)
                    k += 1
            stream.synchronize()

        def backup():
            k, prev = 0, None
            for layer in range(LAYERS):
                for c0 in range(0, tokens, chunk_rows):
                    sel = idx[c0:c0 + chunk_rows]
                    b = k % len(staging)
                    with torch.cuda.stream(stream):
                        staging[b][: len(sel)].copy_(dev[layer, c0:c0 + len(sel)], non_blocking=True)
                        done[b].record(stream)
                    if prev is not None:  # scatter the previous chunk while this one copies
                        pb, pl, psel = prev
                        done[pb].synchronize()
                        host[pl].index_copy_(0, psel, staging[pb][: len(psel)])
                    prev, k = (b, layer, sel), k + 1
            pb, pl, psel = prev
            done[pb].synchronize()
            host[pl].index_copy_(0, psel, staging[pb][: len(psel)])

        for t in threads:
            torch.set_num_threads(t)
            ld, bk = nbytes / timed(load) / 1e9, nbytes / timed(backup) / 1e9
            out[f"pipelined_load/threads{t}/gbps"] = round(ld, 2)
            out[f"pipelined_load/threads{t}/ratio"] = round(ld / out["limit_h2d_gbps"], 3)
            out[f"pipelined_backup/threads{t}/gbps"] = round(bk, 2)
            out[f"pipelined_backup/threads{t}/ratio"] = round(bk / out["limit_d2h_gbps"], 3)
            print(t, out[f"pipelined_load/threads{t}/ratio"], out[f"pipelined_backup/threads{t}/ratio"], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    tok = int(args[args.index("--tokens") + 1]) if "--tokens" in args else 32768
    main(args[0] if args else "/tmp/probe_host_gather.json", tok)
