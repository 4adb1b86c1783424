"""Worker start-up malloc tuning: after ``tune_malloc`` a multi-MB tensor comes from the heap (no mmap per
allocation), where glibc's default maps it anew; ``HYBRIDFLOW_MALLOC_TUNING=0`` leaves the defaults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

PROBE = """
import ctypes, sys
import torch
from hybridflow.controller.host import tune_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = tune_malloc() if sys.argv[1] == "tuned" else False
before = libc.mallinfo2().hblks
tensors = [torch.ones(size >> 2) for size in (4 << 20, 96 << 20)]  # 4 MiB; 96 MiB (an 18.9M model's fp32 grads)
print(applied, libc.mallinfo2().hblks - before)
"""


@pytest.mark.parametrize(("mode", "expected"), [("tuned", "True 0"), ("default", "False 2")])
def test_tuned_heap_serves_multi_megabyte_tensors_without_mmap(mode: str, expected: str) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == expected.split(), out.stdout + out.stderr
