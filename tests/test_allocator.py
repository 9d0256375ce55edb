"""runtimes.keep_freed_memory: a CPU device's process reuses the memory it frees instead of
faulting fresh pages in every step. Checked by its effect (page faults counted by the kernel), in
a process of its own: the setting is process-wide."""
import os
import subprocess
import sys

import pytest

from hetconv import runtimes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A 64 MB map allocated, written and freed, then again: the faults of the second round are counted.
# glibc serves a block that size with a fresh mmap each time unless told to keep freed memory.
SECOND_ROUND_FAULTS = """
import resource, sys
import numpy as np
from hetconv.devices.cpu import CpuDevice
print(CpuDevice(threads=1, deterministic=sys.argv[1] == "deterministic").allocator, file=sys.stderr)
def round_of_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(16 * 2 ** 20, np.float32)
    a[::1024] = 1.0             # every 4 KiB page
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
round_of_faults()
print(round_of_faults())
"""


def _second_round_faults(mode="timed", **env):
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    child_env.update(env, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", SECOND_ROUND_FAULTS, mode], env=child_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]), done.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_a_cpu_device_process_reuses_the_pages_it_frees():
    huge_pages = 64 * 2 ** 20 // (2 * 2 ** 20)     # numpy asks for 2 MiB pages where the kernel has them
    kept, kept_says = _second_round_faults(HETCONV_KEEP_FREED_MEMORY="1")
    if kept_says != "glibc malloc keeping freed memory":
        pytest.skip(f"not glibc here: {kept_says}")
    system, system_says = _second_round_faults(HETCONV_KEEP_FREED_MEMORY="0")
    assert system_says == "malloc as the system's (HETCONV_KEEP_FREED_MEMORY=0)"
    assert system >= huge_pages, f"glibc's default faulted {system} pages in: the test shows nothing here"
    assert kept < system // 10, f"{kept} pages faulted in again, against {system} with glibc's default"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_a_deterministic_device_leaves_the_allocator_as_it_is():
    # a kept heap's blocks are aligned by the run's history, and a GEMM may follow the alignment
    faults, says = _second_round_faults("deterministic", HETCONV_KEEP_FREED_MEMORY="1")
    assert says == "malloc as the system's (--deterministic)"
    assert faults >= 64 * 2 ** 20 // (2 * 2 ** 20)


def test_a_users_own_malloc_settings_are_kept():
    _, says = _second_round_faults(MALLOC_MMAP_MAX_="65536")
    assert says == "malloc as the environment sets it"


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setattr(runtimes, "_allocator", None)
    monkeypatch.setenv(runtimes.KEEP_FREED_MEMORY_ENV, "yes")
    with pytest.raises(ValueError, match=r"HETCONV_KEEP_FREED_MEMORY must be 1 .* or 0 .*got 'yes'"):
        runtimes.keep_freed_memory()
