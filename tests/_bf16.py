"""Where bf16 runs in these tests: wherever oneDNN is installed, on the CPU's bf16 GEMM where it
has one and on its emulation elsewhere (dnnl.Dnnl.emulated_gemm_bf16); only oneDNN's own bf16
convolutions (direct-bf16) and auto's taking bf16 need the instructions. `emulated` opens a device
on the emulation on any CPU, so the emulated paths are checked on hosts with the instructions too."""
import contextlib

import pytest

from hetconv.devices import dnnl, open_device

DNNL_MISSING = dnnl.unavailable_reason()
# why the CPU's own bf16 GEMM cannot run here ('' where it can)
INSTRUCTIONS_MISSING = DNNL_MISSING or dnnl.load().bf16_error
needs_dnnl = pytest.mark.skipif(bool(DNNL_MISSING), reason=f"oneDNN is an optional extra: {DNNL_MISSING}")
needs_instructions = pytest.mark.skipif(bool(INSTRUCTIONS_MISSING),
                                        reason=f"needs the CPU's bf16 instructions: {INSTRUCTIONS_MISSING}")


@contextlib.contextmanager
def bf16_emulated():
    """Devices opened inside run their bf16 GEMMs on the emulation, as on a CPU without the
    instructions (they keep it after the block; the library is as it was)."""
    lib = dnnl.load()
    kept = lib.bf16_error
    lib.bf16_error = kept or "the emulation, asked for by the test"
    try:
        yield
    finally:
        lib.bf16_error = kept


def emulated(**options):
    """A CPU device on the bf16 emulation (see bf16_emulated)."""
    with bf16_emulated():
        device = open_device("cpu", **options)
    assert device.bf16_missing and device.bf16_emulated == (options.get("precision") == "bf16")
    return device
