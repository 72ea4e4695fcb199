"""CPU probe: does torch get memory numpy advised for huge pages? (why a test saw 'hg' on a plain buffer)

numpy advises MADV_HUGEPAGE for its own large arrays, heap memory included; a torch tensor
given that memory later lies in a mapping flagged ``hg``. 200 rounds of: a numpy array of
1-11 MiB made and freed, then a 4.2 MB torch tensor; counts the tensors in ``hg`` mappings.
2026-12-04, the CI-like CPU: 160 of 200 (seed 0; 181 in a first, unseeded try); 0 of 200 with
``NUMPY_MADVISE_HUGEPAGE=0``. The count moves with what else the process holds: the same code
gave 166 of 200 twice on a later day; reading the flags through ``kvtier.memory.vm_flags``
(which imports kvtier) 172 and 176, and 0 with ``NUMPY_MADVISE_HUGEPAGE=0``.
Usage: python bench/probes/numpy_hugepage.py   (and again with NUMPY_MADVISE_HUGEPAGE=0)
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.memory import vm_flags


def main() -> None:
    rng = np.random.default_rng(0)
    hits, keep = 0, []
    for i in range(200):
        a = np.ones(int(rng.integers(1, 12)) << 20, np.uint8)
        keep.append(np.ones(1000))
        del a
        t = torch.empty((3, 700, 1000), dtype=torch.bfloat16)
        hits += "hg" in vm_flags(t.data_ptr())
        if i % 3 == 0:
            keep.append(t)
    print(f"tensors in hg mappings: {hits} of 200")


if __name__ == "__main__":
    main()
