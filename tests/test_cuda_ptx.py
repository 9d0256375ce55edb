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


# Each subprocess imports numba and the kernels once and answers several checks; one per compute
# capability, so every generation's kernels and device functions are compiled in a fresh process.
# The two run side by side: compiling is one core's work each.
CHECKS = {"9.0": ["9.0", "9.0 --mistyped", "9.0 --int64-toy", "9.0 --update-arithmetic"], "7.5": ["7.5"]}
BATCH = """
import json, sys
sys.path.insert(0, sys.argv[1])
import _cuda_ptx_check as check
print(json.dumps([check.main([check.__file__, *args.split()]) for args in sys.argv[2:]]))
"""


@pytest.fixture(scope="module")
def checks():
    """{"9.0 --mistyped": result, ...}: what `_cuda_ptx_check.py ARGS` prints, for every ARGS in CHECKS."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    started = [(batch, subprocess.Popen([sys.executable, "-c", BATCH, str(CHECK.parent), *batch], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
               for batch in CHECKS.values()]
    results = {}
    try:
        for batch, proc in started:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"{CHECK.name} {batch} failed:\n{err[-4000:]}"
            results.update(zip(batch, json.loads(out.strip().splitlines()[-1])))
    finally:
        for _, proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _result(checks, args):
    result = checks[args]
    if "no_nvvm" in result:
        pytest.skip(result["no_nvvm"])
    return result


@pytest.mark.parametrize("cc", ["9.0", "7.5"])   # H100; Turing, the oldest CUDA 13 targets
def test_every_kernel_compiles_to_ptx(checks, cc):
    result = _result(checks, cc)
    assert result["unlisted"] == [], f"kernels missing from PTX_SIGNATURES: {result['unlisted']}"
    assert result["failed"] == [], "\n\n".join(f"{f['kernel']}:\n{f['error']}" for f in result["failed"])
    assert len(result["compiled"]) >= len(result["kernels"]) >= 1, result


def test_a_mistyped_kernel_is_rejected(checks):
    """The check above can fail: a kernel given arrays of the wrong rank does not compile."""
    result = _result(checks, "9.0 --mistyped")
    assert result["rejected"], "compile_ptx accepted 2-D arrays for a kernel that indexes 4-D ones"
    assert result["error"] == "TypingError", result


def test_index_math_has_no_64_bit_division_or_float64(checks):
    """Every kernel's sm_90 PTX: no div/rem on 64-bit integers (a software routine of tens of
    instructions per use) and no .f64 instruction (a stray float64 in float32 code)."""
    result = _result(checks, "9.0")
    assert result["failed"] == [], result["failed"]
    assert result["counts"], result
    slow = {name: c for name, c in result["counts"].items()
            if c["div_rem_64"] or (c["f64"] and not c["float64_on_purpose"])}
    assert not slow, "kernels with 64-bit div/rem or f64 instructions:\n" + "\n".join(
        f"{name}: {c['div_rem_64']} div/rem .s64/.u64, {c['f64']} .f64" for name, c in slow.items())


def test_the_slow_instruction_count_catches_int64_division(checks):
    """The check above can fail: a kernel dividing int64 and computing in float64 is counted."""
    result = _result(checks, "9.0 --int64-toy")
    assert result["div_rem_64"] >= 2, result
    assert result["f64"] >= 1, result


def test_update_kernels_round_every_operation_as_the_cpu_does(checks):
    """The optimizer kernels' sm_90 PTX: every float multiply, add, division and square root
    rounded on its own (.rn), none fused into an fma, approximated, flushing subnormals, or left
    without a rounding mode (NVVM contracts those into an fma): the CPU device rounds each apart,
    so data-parallel copies of a weight on a CPU and a GPU stay bit-identical."""
    result = _result(checks, "9.0 --update-arithmetic")
    assert result["listed"] == ["_adamw", "_scale", "_sgd", "_square_sums"], result
    assert sorted(result["kernels"]) == result["listed"], "an update kernel is missing from PTX_SIGNATURES"
    hazards = {name: {k: n for k, n in c.items() if k != "rounded" and n}
               for name, c in result["kernels"].items()}
    assert not any(hazards.values()), f"update kernels with fused, approximate or contractible float ops: {hazards}"
    assert all(c["rounded"] >= 1 for c in result["kernels"].values()), result


def test_the_float_instruction_count_catches_contraction_and_approximation(checks):
    """The check above can fail: plain operators give an fma (a*b + c, as the SGD kernel once
    had), and under fastmath also an approximate sqrt and division, and flushed subnormals."""
    result = _result(checks, "9.0 --update-arithmetic")
    assert result["toy"]["fused"] >= 1, result["toy"]
    fast = result["toy_fastmath"]
    assert fast["fused"] >= 1 and fast["approximate"] >= 2 and fast["flushes_subnormals"] >= 1, fast
