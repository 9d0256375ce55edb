"""Checkpoint files as a user may be handed them: every command that reads one (hetconv-eval,
hetconv-export, --resume, sorting a directory) refuses a hostile file in one line, exit 2, without
the memory it asks for; and a .npz export needs no PyTorch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _hostile_checkpoints as hostile  # noqa: E402

from hetconv.net import NetSpec  # noqa: E402
from hetconv.training import checkpoint  # noqa: E402

REPO = Path(__file__).parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

SAID = {
    "meta deflated to 300 KB, 300 MB inflated": "its meta declares 300 MB, more than the 2 MB a checkpoint's meta may hold",
    "meta declaring 2 KB, inflating to 300 MB": "entry 'meta' has no readable .npy header (BadZipFile: Bad CRC-32",
    "fc0.w deflated, 1.25 GB inflated": "entry 'fc0.w' declares 1254400128 bytes; its network's float32 (10, 784) "
                                        "takes 31360 and a header",
    "network of 10^9 kernels in the meta": "its network needs 14.8 TB of arrays, more than this machine's",
    "conv0.b float64, checksum consistent": "array conv0.b is float64 (4,); its network needs float32 (4,)",
    "fc0.b and its momentum (1,) float64": "array fc0.b is float64 (1,); its network needs float32 (10,)",
    "NaN in fc0.w": "array fc0.w holds NaN or inf",
}
RSS_MB = 16            # what a refusal may add to the process's peak: none of the files' hundreds of MB


def test_hostile_checkpoints_are_refused_in_one_line_without_the_memory(tmp_path):
    """Each file, with each command, in one process after a warm-up (see _hostile_checkpoints):
    the run is bounded by the subprocess's timeout, each refusal's peak RSS growth measured."""
    result = subprocess.run([sys.executable, str(REPO / "tests" / "_hostile_checkpoints.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    refusals = [r for r in rows if r["case"] in SAID]
    assert len(refusals) == 3 * len(SAID)
    for r in refusals:
        assert r["code"] == 2 and r["stderr_lines"] == 1, r
        assert f"{tmp_path / r['file']}: {SAID[r['case']]}" in r["said"], r
        assert r["rss_growth_mb"] < RSS_MB, r
    sort, evaluate = [r for r in rows if r["file"] == "sorting/"]
    # sorting reads metas only: the 300 MB one is refused by its declared size, never inflated
    assert sort["code"] == 0 and sort["rss_growth_mb"] < RSS_MB, sort
    assert evaluate["code"] == 0, evaluate                  # the good one among them is found and used


def test_a_directory_lists_unreadable_files_last_and_says_why_when_they_may_be_newer(tmp_path):
    files = hostile.make_hostile(tmp_path)
    good = checkpoint.latest(str(tmp_path / "good"))
    os.link(files["meta deflated to 300 KB, 300 MB inflated"], tmp_path / "good" / "ckpt-step0000009.npz")
    assert [os.path.basename(p) for p in checkpoint.checkpoints(str(tmp_path / "good"))] == [
        os.path.basename(good), "ckpt-step0000009.npz"]
    meta, _, _, skipped = checkpoint.load_newest_valid(str(tmp_path / "good"))
    assert meta["path"] == good
    assert skipped == [("ckpt-step0000009.npz",
                        "its meta declares 300 MB, more than the 2 MB a checkpoint's meta may hold")]


def test_npz_export_needs_no_pytorch(tmp_path):
    path = hostile.good_checkpoint(tmp_path / "ck")
    out = tmp_path / "model.npz"
    code = ("import sys; sys.modules['torch'] = None\n"           # import torch raises ImportError
            "from hetconv.cli import export\n"
            f"sys.exit(export.main([{str(path)!r}, '--format', 'npz', '--out', {str(out)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr
    _, conv, fc = checkpoint.load(path)
    with np.load(out, allow_pickle=False) as z:
        assert sorted(z.files) == ["0.bias", "0.weight", "4.bias", "4.weight", "data", "network"]
        # layer 0 is the conv, layer 4 the linear (after relu, maxpool, flatten): nn.Sequential's indices
        for name, want in (("0.weight", conv[0]["w"]), ("0.bias", conv[0]["b"]), ("4.weight", fc[0]["w"]),
                           ("4.bias", fc[0]["b"])):
            assert z[name].dtype == np.float32
            np.testing.assert_array_equal(z[name], want)
        assert NetSpec.from_json(str(z["network"])) == NetSpec.from_json(hostile.NETWORK)
