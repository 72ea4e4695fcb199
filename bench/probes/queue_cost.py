"""Probe: what queueing a batch of small copies costs the host, and whether two threads share it.

After run 124: DMA's pairs on single scattered tokens are host-bound. MHA page_first, 32k
tokens, both ways by DMA: the load's call returned after 63.5 ms and the backup's last copy
was queued at 109.5 ms, when both ended on the device (109.6 and 129.7 ms; 1.16x). Each way
is 32,822 copies of ~128 KiB (runs of host slots, K and V). The DMA planner's own share is
13-14 ms a way (``dma_plan_time.py``, CPU); the rest is the runtime's. The copy engines
alone move such copies both ways at 76 GB/s (64 KiB) and 85 GB/s (128 KiB) when queued ahead
(run 82, ``probe_copy_streams_h200.json``): 1.37-1.53x of one way, if the host kept up.

Arms, for 32,768 copies of 64 KiB and 128 KiB to random places in a pinned host buffer:
the host's wall time to queue them with ``cudaMemcpyBatchAsync`` in calls of 128, 512 and
2,048 copies on one stream (the backend queues at most a chunk's copies per call), one
thread; and the same copies split over two threads, each queueing its half on its own stream
(ctypes lets go of the GIL during the call). Also both ways at once, a thread per way, as a
pair's backup and load are queued. Per arm: host microseconds per copy (median of five) and
the device's GB/s from the gate that holds the copies until all are queued (a spin of ~150 ms
ahead of it; where the host takes longer, the device time includes the rest of the queueing)
to the last copy's end.
Predictions: about 1-1.5 us of host time per copy at 512 a call, less per copy in larger
calls; if the runtime serializes queueing (one lock per context), two threads take as long
as one and DMA both ways on single tokens stays host-bound (blocked); if not, two threads
halve the wall time, and the DMA backend could queue a pair's two directions at once.
Run 126 (``probe_queue_cost_h200_run126.json``, 32,768 copies): from one thread onto one
stream the host blocked until the gate opened (~164 ms, the spin): the runtime holds fewer
than 32k copies pending on a stream, so a call that gets that far ahead waits on the device.
Both ways at once, queued ahead: 93-95 GB/s (1.69-1.72x of one way).
Run 127 (``probe_queue_cost_h200_16k_run127.json``, ``--copies 16384``): 0.40-0.48 us a copy
from one thread in batches of 128-2,048, and two threads on two streams no faster in all
(0.42-0.60 us a copy): the runtime queues for one thread at a time. Both ways 92-97 GB/s.
After run 132 (not yet run): ``--neighbour``: does a thread blocked in the runtime (its stream
holds as many copies pending as it takes) hold up another thread queueing on another stream?
Thread A queues 32k device-to-host copies behind a ~150 ms gate and blocks; 20 ms later this
thread queues 4,096 host-to-device copies onto a free stream; its host ms against the same
alone, and whether A was still blocked when it finished. DMA's single-token pairs put 32k
copies a way on two streams from two threads: if the blocked one holds up the other, the two
directions are queued in turn, whatever the GIL does. Prediction: not held up (the runtime
queues for one thread at a time but does not wait on the device while it holds its lock).
Usage: python bench/probes/queue_cost.py OUT.json [--copies N] [--neighbour]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
import torch

from kvtier.transfer import cudart
from probelib import JsonLog, args

COPIES = int(sys.argv[sys.argv.index("--copies") + 1]) if "--copies" in sys.argv else 32768
SIZES = (64 << 10, 128 << 10)
PER_CALL = (128, 512, 2048)
PATH, _ = args("/tmp/probe_queue_cost.json")
log = JsonLog(PATH, copies=COPIES)


def queue(dst: np.ndarray, src: np.ndarray, size: int, per_call: int, stream: torch.cuda.Stream) -> None:
    sizes = np.full(per_call, size, dtype=np.uint64)
    for j in range(0, dst.size, per_call):
        n = min(per_call, dst.size - j)
        cudart.memcpy_batch(dst[j:j + n], src[j:j + n], sizes[:n], stream.cuda_stream)


def timed(jobs: list[tuple], per_call: int) -> tuple[float, float]:
    """Queue each job ``(dst, src, size, stream)`` on a thread of its own (one job: this
    thread); the host's wall time to queue them all, and the device's seconds from the gate
    the copies wait behind to the last copy's end."""
    cur = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # Hold the streams until every job is queued, so the device time is the copies', not the queueing's.
    gate = torch.cuda.Event()
    # ~150 ms at 2 GHz on the current stream, ahead of the gate: longer than the queueing is
    # predicted to take (both ways, 2 x 32k copies at ~1.5 us), so the copies start together.
    torch.cuda._sleep(300_000_000)
    start.record(cur)
    gate.record(cur)
    for *_, s in jobs:
        s.wait_event(gate)
    t0 = time.perf_counter()
    if len(jobs) == 1:
        queue(*jobs[0][:3], per_call, jobs[0][3])
    else:
        threads = [threading.Thread(target=queue, args=(*j[:3], per_call, j[3])) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    host = time.perf_counter() - t0
    for *_, s in jobs:
        cur.wait_stream(s)
    end.record(cur)
    end.synchronize()
    return host, start.elapsed_time(end) / 1e3


NEAR = 4096  # the neighbour's copies: well under what a stream holds pending


def neighbour(h_out, d_out, d_in, h_in, size: int, streams) -> tuple[float, float, bool]:
    """(host seconds for NEAR copies on ``streams[1]`` alone, the same while another thread is
    blocked queueing ``h_out.size`` gated copies on ``streams[0]``, whether it still was after)."""
    t0 = time.perf_counter()
    queue(d_in[:NEAR], h_in[:NEAR], size, 512, streams[1])
    alone = time.perf_counter() - t0
    torch.cuda.synchronize()
    cur = torch.cuda.current_stream()
    torch.cuda._sleep(300_000_000)  # ~150 ms ahead of the gate, as in timed()
    gate = torch.cuda.Event()
    gate.record(cur)
    streams[0].wait_event(gate)
    blocked = threading.Thread(target=queue, args=(h_out, d_out, size, 512, streams[0]))
    blocked.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    queue(d_in[:NEAR], h_in[:NEAR], size, 512, streams[1])
    beside = time.perf_counter() - t0
    still = blocked.is_alive()
    blocked.join()
    torch.cuda.synchronize()
    return alone, beside, still


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())  # batched copies refuse the legacy default stream
    streams = [torch.cuda.Stream() for _ in range(2)]
    rng = np.random.default_rng(0)
    for size in SIZES:
        payload = COPIES * size
        host = torch.empty(4 * payload, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(2 * payload, dtype=torch.uint8, device="cuda")
        places = rng.permutation(4 * COPIES)[: 2 * COPIES].astype(np.uint64) * np.uint64(size)
        h_out, h_in = places[:COPIES] + np.uint64(host.data_ptr()), places[COPIES:] + np.uint64(host.data_ptr())
        d_out = np.arange(COPIES, dtype=np.uint64) * np.uint64(size) + np.uint64(dev.data_ptr())
        d_in = d_out + np.uint64(payload)
        half = COPIES // 2
        if "--neighbour" in sys.argv:
            neighbour(h_out, d_out, d_in, h_in, size, streams)  # warm-up
            runs = [neighbour(h_out, d_out, d_in, h_in, size, streams) for _ in range(3)]
            log(f"{size >> 10}KiB neighbour of a blocked thread", {
                "alone_ms": [round(1e3 * r[0], 2) for r in runs], "beside_ms": [round(1e3 * r[1], 2) for r in runs],
                "blocked_thread_still_waiting": [r[2] for r in runs]})
            del host, dev
            torch.cuda.empty_cache()
            continue
        arms = {
            "d2h, 1 thread": [(h_out, d_out, size, streams[0])],
            "d2h, 2 threads": [(h_out[:half], d_out[:half], size, streams[0]),
                               (h_out[half:], d_out[half:], size, streams[1])],
            "both, 1 thread each way": [(h_out, d_out, size, streams[0]), (d_in, h_in, size, streams[1])],
        }
        for per_call in PER_CALL:
            cells = {}
            for name, jobs in arms.items():
                timed(jobs, per_call)  # warm-up
                runs = [timed(jobs, per_call) for _ in range(5)]
                n = sum(j[0].size for j in jobs)
                host_s = statistics.median(r[0] for r in runs)
                dev_s = statistics.median(r[1] for r in runs)
                cells[name] = {"host_us_per_copy": round(1e6 * host_s / n, 3), "host_ms": round(1e3 * host_s, 2),
                               "device_gbps": round(n * size / dev_s / 1e9, 2)}
            log(f"{size >> 10}KiB/{per_call} per call", cells)
        del host, dev
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
