"""Compile every kernel of hetconv.devices.cuda to PTX for one compute capability, with no GPU.

Run by tests/test_cuda_ptx.py in a subprocess whose environment has NUMBA_ENABLE_CUDASIM removed
(the simulator does not compile). Prints one JSON object on stdout:

    python tests/_cuda_ptx_check.py 9.0              every kernel in PTX_SIGNATURES, plus coverage
                                                     and its slow-instruction counts
    python tests/_cuda_ptx_check.py 9.0 --mistyped   a real kernel under a wrong signature
    python tests/_cuda_ptx_check.py 9.0 --int64-toy  counts for a kernel that divides int64 on purpose
    python tests/_cuda_ptx_check.py 9.0 --update-arithmetic
                                                     the optimizer kernels' float instructions, and
                                                     those of a toy that contracts and approximates
"""
import json
import math
import re
import sys
import types as pytypes

# 64-bit integer division and remainder: no hardware instruction, a long software routine per use
DIV64 = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:div|rem)\.[su]64\b", re.M)
# any double-precision instruction: a 1/64-rate unit on most GPUs, and a sign of a stray float64
F64 = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.]*\.f64\b", re.M)


def slow_instruction_counts(ptx):
    return {"div_rem_64": len(DIV64.findall(ptx)), "f64": len(F64.findall(ptx))}


# Float instructions that would make a GPU update differ from the CPU's, which rounds every
# multiply and add apart, IEEE sqrt and division, subnormals kept: a fused multiply-add (fma,
# mad), an approximation (sqrt/div/rcp/rsqrt .approx, div.full), a flush of subnormals (.ftz),
# and a multiply or add with no rounding mode, which NVVM is free to contract into an fma.
_PRED = r"^\s*(?:@!?%p\d+\s+)?"
FLOAT_HAZARDS = {
    "fused": re.compile(_PRED + r"(?:fma|mad)\.[\w.]*f(?:32|64)\b", re.M),
    "approximate": re.compile(_PRED + r"[a-z]+\.(?:[\w.]*\.)?(?:approx|full)\.[\w.]*f(?:32|64)\b", re.M),
    "flushes_subnormals": re.compile(_PRED + r"[a-z]+\.[\w.]*ftz[\w.]*f(?:32|64)\b", re.M),
    "contractible": re.compile(_PRED + r"(?:mul|add|sub)\.f(?:32|64)\b", re.M),
}
ROUNDED = re.compile(_PRED + r"(?:mul|add|div|sqrt)\.rn\.f(?:32|64)\b", re.M)


def float_instruction_counts(ptx):
    return {**{name: len(p.findall(ptx)) for name, p in FLOAT_HAZARDS.items()}, "rounded": len(ROUNDED.findall(ptx))}


def _contracting_toy(a, x, y):
    """Plain operators, as a kernel would be written without care: NVVM fuses the multiply and
    the add even without fastmath; with it, every hazard above appears."""
    i = a.shape[0] - 1
    a[i] = math.sqrt(a[i]) / x * y + a[0]


def _int64_toy(a, n):
    """Divides and takes the remainder of int64 values, and mixes in a float64: what the counts
    must catch."""
    i = a.shape[0] - 1
    a[i % n] = (i // n) * 0.5


def _compile_device_functions_for(cc):
    """compile_ptx needs no driver, but a device function called from a kernel is compiled for
    the current device's compute capability (numba-cuda 0.30), which needs one. Pretend the
    current device is the target: the kernel's own PTX is produced for `cc` either way."""
    import numba.cuda.dispatcher as dispatcher
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)


def main(argv):
    cc = tuple(int(p) for p in argv[1].split("."))
    mistyped = "--mistyped" in argv[2:]
    from numba import cuda, float32, float64, int8, int64
    from numba.cuda.cudadrv import nvvm
    from numba.cuda.dispatcher import CUDADispatcher

    if not nvvm.is_available():
        return {"no_nvvm": "NVVM not found: install numba-cuda with its CUDA extra, e.g. numba-cuda[cu13]"}
    _compile_device_functions_for(cc)
    import hetconv.devices.cuda as module

    if mistyped:
        # relu_maxpool2 indexes 4-D arrays; 2-D ones must be refused at compile time
        f2, i2 = float32[:, ::1], int8[:, ::1]
        try:
            cuda.compile_ptx(module._relu_maxpool2, (f2, f2, i2), cc=cc)
        except Exception as e:
            return {"rejected": True, "error": type(e).__name__, "message": str(e)[:400]}
        return {"rejected": False}
    if "--int64-toy" in argv[2:]:
        ptx, _ = cuda.compile_ptx(_int64_toy, (float64[::1], int64), cc=cc)
        return {"kernel": "_int64_toy", **slow_instruction_counts(ptx)}

    if "--update-arithmetic" in argv[2:]:
        counts = {fn.__name__: float_instruction_counts(cuda.compile_ptx(fn, sig, cc=cc)[0])
                  for fn, sig in module.PTX_SIGNATURES if fn in module.UPDATE_KERNELS}
        toy_sig = (float32[::1], float32, float32)
        plain, _ = cuda.compile_ptx(_contracting_toy, toy_sig, cc=cc)
        fast, _ = cuda.compile_ptx(_contracting_toy, toy_sig, cc=cc, fastmath=True)
        return {"kernels": counts, "toy": float_instruction_counts(plain),
                "toy_fastmath": float_instruction_counts(fast),
                "listed": sorted(fn.__name__ for fn in module.UPDATE_KERNELS)}

    listed = {fn for fn, _ in module.PTX_SIGNATURES}
    kernels = {name: obj for name, obj in vars(module).items()
               if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")}
    unlisted = sorted(name for name, k in kernels.items() if k.py_func not in listed)
    compiled, failed, counts = [], [], {}
    target = f".target sm_{cc[0]}{cc[1]}"
    for fn, sig in module.PTX_SIGNATURES:
        name = f"{fn.__module__}.{fn.__qualname__}{tuple(str(t) for t in sig)}"
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
        except Exception as e:
            failed.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            continue
        if target not in ptx:
            failed.append({"kernel": name, "error": f"PTX lacks {target!r}"})
        else:
            compiled.append(name)
            counts[name] = {**slow_instruction_counts(ptx), "float64_on_purpose": fn in module.FLOAT64_KERNELS}
    return {"cc": list(cc), "kernels": sorted(kernels), "unlisted": unlisted,
            "compiled": compiled, "failed": failed, "counts": counts}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv)))
