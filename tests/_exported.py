"""Running an exported torch program the way a user without hetconv would: in a child Python
whose import path holds neither the checkout nor the editable install."""
import os
import subprocess
import sys

import numpy as np

RUN_EXPORTED = """
import os, sys
# neither the checkout nor the editable install: the program must run on PyTorch alone
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in (getattr(f, "__module__", "") or "")]
sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or os.curdir, "hetconv"))]
import importlib.util
assert importlib.util.find_spec("hetconv") is None, "hetconv is importable"
import numpy as np
import torch
module = torch.export.load(sys.argv[1]).module()
with torch.no_grad():
    np.save(sys.argv[3], module(torch.from_numpy(np.load(sys.argv[2]))).numpy())
print("hetconv importable:", importlib.util.find_spec("hetconv") is not None)
"""


def exported_logits(program, images, tmp_path):
    """The logits the .pt2 `program` gives for float32 `images` in [0, 1], computed without hetconv."""
    np.save(tmp_path / "x.npy", images)
    script = tmp_path / "run_exported.py"
    script.write_text(RUN_EXPORTED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([sys.executable, str(script), str(program), str(tmp_path / "x.npy"),
                          str(tmp_path / "logits.npy")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert got.returncode == 0, got.stderr
    assert "hetconv importable: False" in got.stdout
    return np.load(tmp_path / "logits.npy")
