"""Every CUDA kernel compiles to PTX with the real numba-cuda compiler (no GPU, no simulator).

The simulator runs kernels as Python and accepts code the real compiler refuses (non-constant
shared-memory shapes, float64 literals in float32 arrays...). This compiles each kernel of
devices/cuda.py, with the signature it is launched with, for a current and an older GPU, in a
subprocess whose environment has the simulator switched off.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("_cuda_ptx_check.py")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                reason="numba-cuda is not installed (pip install 'hetconv[cuda]')")


def _run_check(*args):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{CHECK.name} {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "no_nvvm" in result:
        pytest.skip(result["no_nvvm"])
    return result


@pytest.mark.parametrize("cc", ["9.0", "7.5"])   # H100; Turing, the oldest CUDA 13 targets
def test_every_kernel_compiles_to_ptx(cc):
    result = _run_check(cc)
    assert result["unlisted"] == [], f"kernels missing from PTX_SIGNATURES: {result['unlisted']}"
    assert result["failed"] == [], "\n\n".join(f"{f['kernel']}:\n{f['error']}" for f in result["failed"])
    assert len(result["compiled"]) >= len(result["kernels"]) >= 1, result


def test_a_mistyped_kernel_is_rejected():
    """The check above can fail: a kernel given arrays of the wrong rank does not compile."""
    result = _run_check("9.0", "--mistyped")
    assert result["rejected"], "compile_ptx accepted 2-D arrays for a kernel that indexes 4-D ones"
    assert result["error"] == "TypingError", result


def test_index_math_has_no_64_bit_division_or_float64():
    """Every kernel's sm_90 PTX: no div/rem on 64-bit integers (a software routine of tens of
    instructions per use) and no .f64 instruction (a stray float64 in float32 code)."""
    result = _run_check("9.0")
    assert result["failed"] == [], result["failed"]
    assert result["counts"], result
    slow = {name: c for name, c in result["counts"].items() if c["div_rem_64"] or c["f64"]}
    assert not slow, "kernels with 64-bit div/rem or f64 instructions:\n" + "\n".join(
        f"{name}: {c['div_rem_64']} div/rem .s64/.u64, {c['f64']} .f64" for name, c in slow.items())


def test_the_slow_instruction_count_catches_int64_division():
    """The check above can fail: a kernel dividing int64 and computing in float64 is counted."""
    result = _run_check("9.0", "--int64-toy")
    assert result["div_rem_64"] >= 2, result
    assert result["f64"] >= 1, result
