"""Run the Triton interpreter cases (tests/kernels/interpret_cases.py) in a process of their own.

TRITON_INTERPRET=1 turns every ``@triton.jit`` kernel defined afterwards into
the interpreter, for the whole process: set in the main test process it would
send the GPU tests' kernels through the interpreter too (which segfaults on
device pointers). So the cases get a fresh interpreter process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_under_the_interpreter():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
         str(here / "interpret_cases.py")],
        capture_output=True, text=True, env=env, cwd=here.parents[1], timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout
