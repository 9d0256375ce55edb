"""Every per-channel CUDA kernel (devices/cuda_channelwise.py) compiles to PTX with the real
numba-cuda compiler (no GPU, no simulator), for a current and an older GPU, in a subprocess whose
environment has the simulator switched off: the simulator runs kernels as Python and accepts
code the compiler refuses. Counts what is slow on a GPU as tests/test_cuda_ptx.py does."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                reason="numba-cuda is not installed (pip install 'hetconv[cuda]')")

CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import _cuda_ptx_check as check
from numba import cuda
from numba.cuda.cudadrv import nvvm
from numba.cuda.dispatcher import CUDADispatcher

def compile_all(cc):
    if not nvvm.is_available():
        return {"no_nvvm": "NVVM not found: install numba-cuda with its CUDA extra, e.g. numba-cuda[cu13]"}
    check._compile_device_functions_for(cc)
    import hetconv.devices.cuda_channelwise as module
    listed = {fn for fn, _ in module.PTX_SIGNATURES}
    kernels = {name: k for name, k in vars(module).items()
               if isinstance(k, CUDADispatcher) and not k.targetoptions.get("device")}
    result = {"kernels": sorted(kernels), "unlisted": sorted(n for n, k in kernels.items() if k.py_func not in listed),
              "failed": [], "counts": {}}
    for fn, sig in module.PTX_SIGNATURES:
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
        except Exception as e:
            result["failed"].append(f"{fn.__name__}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        if f".target sm_{cc[0]}{cc[1]}" not in ptx:
            result["failed"].append(f"{fn.__name__}: PTX lacks sm_{cc[0]}{cc[1]}")
        counts = check.slow_instruction_counts(ptx)
        counts["float64_on_purpose"] = fn in module.FLOAT64_KERNELS
        result["counts"][fn.__name__] = counts
    return result

print(json.dumps({cc: compile_all(tuple(int(p) for p in cc.split("."))) for cc in sys.argv[2:]}))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", CHECK, str(Path(__file__).parent), "9.0", "7.5"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    if any("no_nvvm" in r for r in results.values()):
        pytest.skip(next(iter(results.values()))["no_nvvm"])
    return results


@pytest.mark.parametrize("cc", ["9.0", "7.5"])     # H100; Turing, the oldest CUDA 13 targets
def test_every_per_channel_kernel_compiles_to_ptx(compiled, cc):
    result = compiled[cc]
    assert result["unlisted"] == [], f"kernels missing from PTX_SIGNATURES: {result['unlisted']}"
    assert result["failed"] == [], "\n\n".join(result["failed"])
    assert len(result["counts"]) == len(result["kernels"]) >= 6, result


def test_no_64_bit_division_and_float64_only_in_the_sums(compiled):
    counts = compiled["9.0"]["counts"]
    assert not {name: c for name, c in counts.items() if c["div_rem_64"]}, counts
    assert not {name: c for name, c in counts.items() if c["f64"] and not c["float64_on_purpose"]}, counts
    # the sums do accumulate in float64: the count sees it
    assert all(c["f64"] > 0 for c in counts.values() if c["float64_on_purpose"]), counts
