"""CPU probe: does auto's score favour the candidate it already runs?

The chooser scores a candidate by the second best of all its samples, and the one it runs
gathers many more than the one it explored three times: an order statistic that grows with the
count. Run 131's one auto miss (MLA layer_first page-64 scattered load: auto on the kernel,
0.867x, against DMA's 0.917x) had the kernel at 13 samples and DMA at 4. This runs the
chooser itself (``OnlineChooser.pick`` and ``record``) on two candidates of known rates with
i.i.d. noise, prior order kernel first, and reports how often it ends on the faster one, with
the score as it is and with the median of the last three samples.
Outcome (after run 131): 83-100% and 90-100% for noise of 1-3%: not the cause of the miss.
Usage: PYTHONPATH=. python bench/probes/chooser_sim.py
"""

from __future__ import annotations

import statistics

import numpy as np

import kvtier.transfer.online as online

TRUE = {"kernel": 48.0, "dma": 50.4}  # run 131's rows: kernel 48.05, DMA 50.39 GB/s
TRANSFERS, SEEDS = 22, 400


def last_three(samples: list[float]) -> float:
    s = samples[-3:]
    return sorted(s)[-2] if len(s) >= 3 else max(s)


def share_on_faster(sigma: float, scorer) -> float:
    kept = online.score
    online.score = scorer
    try:
        on = []
        for seed in range(SEEDS):
            rng = np.random.default_rng(seed)
            ch = online.OnlineChooser(explore=3)
            picks = []
            for _ in range(TRANSFERS):
                c = ch.pick(("shape",), ["kernel", "dma"])
                ch.record(("shape",), c, TRUE[c] * (1 + sigma * rng.standard_normal()))
                picks.append(c)
            on.append(statistics.mean(c == "dma" for c in picks[6:]) > 0.5)  # after exploring
        return float(np.mean(on))
    finally:
        online.score = kept


if __name__ == "__main__":
    for sigma in (0.01, 0.02, 0.03):
        print(f"noise {sigma:.0%}: second best of all {share_on_faster(sigma, online.score):.2f}, "
              f"median of the last three {share_on_faster(sigma, last_three):.2f}")
