"""Working memory of forward+backward at N=1024, V=32768 (H=128), measured in fresh processes.

Method (tests/kernels/_memory_probe.py): peak RSS (VmHWM, reset through /proc/self/clear_refs) during a step above
the RSS at its start, minus the returned gradients, with glibc's mmap threshold fixed so freed memory leaves RSS.
Logits would take N V 4 B = 128 MiB. Measured (torch 2.13 CPU): fused, chunk 128 (16 MiB buffer), entropy on:
18.9 MB per step in steady state, 33.6 MB on the first step (BLAS scratch and lazy inits); naive: 385-398 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

MIB = 1 << 20
LOGITS = 1024 * 32768 * 4  # 128 MiB
STEADY_BOUND = 24 * MIB  # the 16 MiB logits buffer + 8 MiB of [chunk, H] temporaries: 0.19 of the logits
FIRST_BOUND = 40 * MIB  # plus one-time library allocations on the first step


def _clear_refs_works() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def probe(method: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels._memory_probe", method], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_works(),
                    reason="needs Linux >= 4.0 with a writable /proc/self/clear_refs to reset the peak-RSS mark")
def test_fused_working_memory_is_far_below_logits():
    naive = probe("naive")
    assert min(naive["extra"]) > 2 * LOGITS  # the measurement sees materialised logits (logits, softmax, grads)
    fused = probe("ours")
    first, steady = fused["extra"]
    assert steady <= STEADY_BOUND, f"steady-state working memory {steady / MIB:.1f} MiB > {STEADY_BOUND / MIB} MiB"
    assert first <= FIRST_BOUND, f"first-step working memory {first / MIB:.1f} MiB > {FIRST_BOUND / MIB} MiB"
