"""Checkpoints: one .npz per save (no pickle), written to a temporary file and renamed into place,
so a crash mid-write never leaves a half checkpoint where a good one was."""
import json
import os
import re
import tempfile

import numpy as np

FORMAT = 1
_NAME_RE = re.compile(r"^ckpt-step(\d+)\.npz$")


class CheckpointError(ValueError):
    pass


def save(directory, step, epoch, config, conv_params, fc_params, plan=None):
    """conv_params / fc_params: per layer (w, b, vw, vb). Returns the path written."""
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    for kind, params in (("conv", conv_params), ("fc", fc_params)):
        for i, (w, b, vw, vb) in enumerate(params):
            arrays[f"{kind}{i}.w"], arrays[f"{kind}{i}.b"] = w, b
            arrays[f"{kind}{i}.vw"], arrays[f"{kind}{i}.vb"] = vw, vb
    meta = {"format": FORMAT, "step": int(step), "epoch": int(epoch), "config": config.to_json(),
            "conv_layers": len(conv_params), "fc_layers": len(fc_params),
            "plan": plan.to_json() if plan is not None else None}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path = os.path.join(directory, f"ckpt-step{int(step):07d}.npz")
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".npz.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def latest(directory):
    """The newest checkpoint in a directory, or None."""
    if not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _NAME_RE.match(name))]
    return os.path.join(directory, max(found)[1]) if found else None


def load(path):
    """Returns (meta dict, conv_params, fc_params). `path` may be a checkpoint or a directory."""
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise CheckpointError(f"{path}: no checkpoint (ckpt-stepNNNNNNN.npz) in this directory")
        path = found
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, expected {FORMAT}")
            params = {}
            for kind in ("conv", "fc"):
                params[kind] = [tuple(z[f"{kind}{i}.{n}"] for n in ("w", "b", "vw", "vb"))
                                for i in range(meta[f"{kind}_layers"])]
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable hetconv checkpoint ({type(e).__name__}: {e})") from None
    meta["path"] = path
    return meta, params["conv"], params["fc"]
