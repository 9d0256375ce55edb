"""Test support: writes small data sets in the official CIFAR-10 python format, so the loader in
hetconv/data.py is tested on files shaped exactly like the real ones (the library only reads)."""
from __future__ import annotations

import io
import os
import pickle
import struct
import tarfile
from pathlib import Path

from hetconv.data import (CIFAR10_CLASSES, DIR_NAME, META_FILE, ROW_BYTES, TAR_NAME, TEST_FILE, TRAIN_FILES,
                          synthetic)


class _Py2StylePickler(pickle._Pickler):
    """Protocol 2 with bytes and ASCII str as Python 2 `str` opcodes, as in the official files.

    Python 3's own protocol-2 pickler writes bytes as _codecs.encode(..., "latin1"), which
    stores a 30 MB data batch as UTF-8 text (about 1.5x the size). The pure-Python pickler is
    slower, but the only large object is one bytes block per file, written in one go.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, raw: bytes, obj):
        n = len(raw)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + raw)
        self.memoize(obj)

    def save_bytes(self, obj):
        self._save_py2_str(obj, obj)

    def save_str(self, obj):
        if obj.isascii():
            self._save_py2_str(obj.encode("ascii"), obj)
        else:
            pickle._Pickler.save_str(self, obj)

    dispatch[bytes] = save_bytes
    dispatch[str] = save_str


def _py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    _Py2StylePickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def write_cifar10(path: str | os.PathLike, n_per_batch: int = 100, seed: int = 0,
                  as_tar: bool = False) -> Path:
    """Write a small data set in the official CIFAR-10 python format; return what to load.

    The images are synthetic(n_train=5 * n_per_batch, n_test=n_per_batch, seed): data_batch_i
    holds train images [(i-1) * n, i * n), test_batch the test images. Files are pickled at
    protocol 2 with bytes keys, 'data' a (n, 3072) uint8 array, 'labels' a list of int.
    Writes path/cifar-10-batches-py/ or, with as_tar, path/cifar-10-python.tar.gz.
    """
    n = n_per_batch
    ds = synthetic(n_train=5 * n, n_test=n, seed=seed)
    files = {}
    for i, name in enumerate(TRAIN_FILES):
        x, y = ds.train_x[i * n:(i + 1) * n], ds.train_y[i * n:(i + 1) * n]
        files[name] = {b"batch_label": f"training batch {i + 1} of 5".encode(),
                       b"labels": [int(v) for v in y],
                       b"data": x.reshape(n, ROW_BYTES),
                       b"filenames": [f"synthetic_{i * n + j}.png".encode() for j in range(n)]}
    files[TEST_FILE] = {b"batch_label": b"testing batch 1 of 1",
                        b"labels": [int(v) for v in ds.test_y],
                        b"data": ds.test_x.reshape(n, ROW_BYTES),
                        b"filenames": [f"synthetic_test_{j}.png".encode() for j in range(n)]}
    files[META_FILE] = {b"num_cases_per_batch": n,
                        b"label_names": [c.encode() for c in CIFAR10_CLASSES],
                        b"num_vis": ROW_BYTES}

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if as_tar:
        archive = path / TAR_NAME
        with tarfile.open(archive, "w:gz") as tar:
            for name, obj in files.items():
                raw = _py2_pickle(obj)
                info = tarfile.TarInfo(f"{DIR_NAME}/{name}")
                info.size = len(raw)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(raw))
        return archive
    root = path / DIR_NAME
    root.mkdir(exist_ok=True)
    for name, obj in files.items():
        (root / name).write_bytes(_py2_pickle(obj))
    return root
