import os

# Test pools are tiny; don't let the default 10 GiB host reserve refuse them on small machines.
os.environ.setdefault("KVTIER_HOST_RESERVE_GB", "1")

import pytest
import torch

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvtier", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("kvtier")

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def devices():
    """CPU always; CUDA (marked gpu) where present."""
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
