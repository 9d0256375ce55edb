"""Data: synthetic set, normalization, batching, and the CIFAR-10 loader on generated files."""

import io
import os
import pickle
import tarfile

import numpy as np
import pytest

from cifar_fixture import write_cifar10
from hetconv.data import (CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, DataError, DataSet,
                          batches, load_cifar10, load_dataset, normalize, synthetic,
                          test_batches)

N = 20  # images per generated CIFAR file: small, so every loader test takes milliseconds


@pytest.fixture(scope="module")
def small():
    return synthetic(n_train=200, n_test=50, seed=3)


@pytest.fixture
def cifar_dir(tmp_path):
    return write_cifar10(tmp_path, n_per_batch=N, seed=1)


def _pickle_to(path, obj):
    path.write_bytes(pickle.dumps(obj, protocol=2))


# ---------------------------------------------------------------------------------------------
# synthetic

def test_synthetic_shapes_and_dtypes(small):
    assert small.name == "synthetic"
    assert small.train_x.shape == (200, 3, 32, 32) and small.train_x.dtype == np.uint8
    assert small.train_y.shape == (200,) and small.train_y.dtype == np.int64
    assert small.test_x.shape == (50, 3, 32, 32) and small.test_x.dtype == np.uint8
    assert small.test_y.shape == (50,) and small.test_y.dtype == np.int64
    assert small.classes == CIFAR10_CLASSES
    assert set(np.unique(small.train_y)) <= set(range(10))


def test_synthetic_is_deterministic_and_seeded():
    a, b, c = synthetic(300, 60, seed=7), synthetic(300, 60, seed=7), synthetic(300, 60, seed=8)
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert getattr(a, field).tobytes() == getattr(b, field).tobytes()
    assert a.train_x.tobytes() != c.train_x.tobytes()


def test_synthetic_test_split_does_not_depend_on_train_size():
    a, b = synthetic(100, 40, seed=2), synthetic(300, 40, seed=2)
    np.testing.assert_array_equal(a.test_x, b.test_x)
    np.testing.assert_array_equal(a.test_y, b.test_y)


def test_synthetic_is_balanced_and_images_differ():
    ds = synthetic(1000, 200, seed=0)
    assert np.bincount(ds.train_y, minlength=10).tolist() == [100] * 10
    assert np.bincount(ds.test_y, minlength=10).tolist() == [20] * 10
    same_class = ds.train_x[ds.train_y == 0]
    assert len({img.tobytes() for img in same_class}) == len(same_class)
    # Uses the uint8 range without collapsing onto its ends.
    assert 30 < ds.train_x.std() < 100
    assert np.mean((ds.train_x == 0) | (ds.train_x == 255)) < 0.15


def _flat(x):
    return normalize(x).reshape(len(x), -1)


def test_synthetic_is_learnable_by_nearest_class_mean():
    ds = synthetic(5000, 1000, seed=0)
    xtr, xte = _flat(ds.train_x), _flat(ds.test_x)
    means = np.stack([xtr[ds.train_y == c].mean(0) for c in range(10)])           # (10, 3072)
    dist = (xte ** 2).sum(1)[:, None] - 2 * xte @ means.T + (means ** 2).sum(1)[None]
    accuracy = np.mean(dist.argmin(1) == ds.test_y)
    assert accuracy > 0.5, f"nearest class mean accuracy {accuracy:.3f}, chance is 0.1"


def test_synthetic_is_learnable_by_a_few_hundred_sgd_steps():
    # Logistic regression, 300 steps of batch 64: the smallest model a training loop might run.
    ds = synthetic(5000, 1000, seed=0)
    rng = np.random.default_rng(0)
    w, b = np.zeros((3072, 10), np.float32), np.zeros(10, np.float32)
    steps = 0
    while steps < 300:
        for x, y in batches(ds, 64, rng):
            x = x.reshape(len(x), -1)
            z = x @ w + b
            z -= z.max(1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(1, keepdims=True)
            p[np.arange(len(y)), y] -= 1                    # dL/dz of softmax cross-entropy
            p /= len(y)
            w -= 0.01 * x.T @ p
            b -= 0.01 * p.sum(0)
            steps += 1
            if steps == 300:
                break
    accuracy = np.mean((_flat(ds.test_x) @ w + b).argmax(1) == ds.test_y)
    assert accuracy > 0.5, f"logistic regression accuracy {accuracy:.3f}, chance is 0.1"


# ---------------------------------------------------------------------------------------------
# normalize and batches

def test_normalize_matches_formula():
    x = np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    mean = np.array(CIFAR10_MEAN).reshape(1, 3, 1, 1)
    std = np.array(CIFAR10_STD).reshape(1, 3, 1, 1)
    out = normalize(x)
    assert out.dtype == np.float32 and out.shape == x.shape and out.flags.c_contiguous
    np.testing.assert_allclose(out, ((x / 255.0) - mean) / std, rtol=1e-5, atol=1e-5)


def test_normalize_rejects_float_and_wrong_channels():
    with pytest.raises(ValueError, match="uint8"):
        normalize(np.zeros((2, 3, 32, 32), np.float32))
    with pytest.raises(ValueError, match=r"\(2, 4, 32, 32\)"):
        normalize(np.zeros((2, 4, 32, 32), np.uint8))


def test_batches_shapes_drop_last_and_each_image_at_most_once(small):
    seen = []
    for x, y in batches(small, 64, np.random.default_rng(0)):
        assert x.shape == (64, 3, 32, 32) and x.dtype == np.float32
        assert y.shape == (64,) and y.dtype == np.int64
        seen.append(x)
    assert len(seen) == 200 // 64                            # the short last batch is dropped
    # Identify images by their bytes (synthetic images are all distinct): no repeats.
    keys = [img.tobytes() for x in seen for img in x]
    assert len(set(keys)) == len(keys)
    all_train = {img.tobytes() for img in normalize(small.train_x)}
    assert set(keys) <= all_train


def test_batches_keep_last_covers_every_image(small):
    sizes, ys = [], []
    for x, y in batches(small, 64, np.random.default_rng(0), drop_last=False):
        sizes.append(len(y))
        ys.append(y)
    assert sizes == [64, 64, 64, 8]
    assert np.bincount(np.concatenate(ys), minlength=10).tolist() == \
        np.bincount(small.train_y, minlength=10).tolist()


def test_batches_are_deterministic_given_the_generator(small):
    def epoch(seed):
        return [(x.copy(), y.copy()) for x, y in batches(small, 50, np.random.default_rng(seed))]
    a, b, c = epoch(5), epoch(5), epoch(6)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert any(not np.array_equal(ya, yc) for (_, ya), (_, yc) in zip(a, c))


def test_batches_without_shuffle_are_in_order(small):
    ys = np.concatenate([y for _, y in batches(small, 50, None, shuffle=False)])
    np.testing.assert_array_equal(ys, small.train_y)


def test_batches_reject_bad_sizes(small):
    with pytest.raises(ValueError, match="batch_size 500 is larger than the 200"):
        next(batches(small, 500, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(batches(small, 0, np.random.default_rng(0)))


def test_test_batches_cover_every_test_image_in_order(small):
    xs, ys = zip(*test_batches(small, 16))
    assert [len(y) for y in ys] == [16, 16, 16, 2]
    np.testing.assert_array_equal(np.concatenate(xs), normalize(small.test_x))
    np.testing.assert_array_equal(np.concatenate(ys), small.test_y)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 loader: round trips

def _expected(seed=1):
    return synthetic(n_train=5 * N, n_test=N, seed=seed)


def _assert_same(ds, ref):
    assert ds.name == "cifar10"
    assert ds.train_x.shape == (5 * N, 3, 32, 32) and ds.train_x.dtype == np.uint8
    assert ds.train_y.dtype == np.int64
    np.testing.assert_array_equal(ds.train_x, ref.train_x)
    np.testing.assert_array_equal(ds.train_y, ref.train_y)
    np.testing.assert_array_equal(ds.test_x, ref.test_x)
    np.testing.assert_array_equal(ds.test_y, ref.test_y)
    assert ds.classes == CIFAR10_CLASSES


def test_round_trip_from_directory(cifar_dir, tmp_path):
    assert cifar_dir == tmp_path / "cifar-10-batches-py"
    _assert_same(load_cifar10(cifar_dir), _expected())
    _assert_same(load_cifar10(tmp_path), _expected())        # the directory that contains it
    _assert_same(load_cifar10(str(tmp_path)), _expected())


def test_round_trip_from_tar_gz(tmp_path):
    archive = write_cifar10(tmp_path, n_per_batch=N, seed=1, as_tar=True)
    assert archive == tmp_path / "cifar-10-python.tar.gz"
    assert sorted(os.listdir(tmp_path)) == ["cifar-10-python.tar.gz"]
    _assert_same(load_cifar10(archive), _expected())
    _assert_same(load_cifar10(tmp_path), _expected())        # a directory holding the archive
    assert sorted(os.listdir(tmp_path)) == ["cifar-10-python.tar.gz"]   # nothing extracted


def test_files_are_in_the_official_layout(cifar_dir):
    # Read back with the plain unpickler, as the CIFAR-10 web page says to.
    with open(cifar_dir / "data_batch_2", "rb") as f:
        d = pickle.load(f, encoding="bytes")
    assert {b"data", b"labels", b"batch_label", b"filenames"} <= set(d)
    assert d[b"data"].shape == (N, 3072) and d[b"data"].dtype == np.uint8
    assert isinstance(d[b"labels"], list) and all(type(v) is int for v in d[b"labels"])
    # Row = R plane, G plane, B plane, each 32x32 row-major -> channel axis 0, 1, 2.
    ds = load_cifar10(cifar_dir)
    row = d[b"data"][3]
    for channel in range(3):
        np.testing.assert_array_equal(ds.train_x[N + 3, channel],
                                      row[channel * 1024:(channel + 1) * 1024].reshape(32, 32))
    with open(cifar_dir / "batches.meta", "rb") as f:
        meta = pickle.load(f, encoding="bytes")
    assert meta[b"label_names"][0] == b"airplane"


def test_label_names_come_from_batches_meta(cifar_dir):
    names = [f"class{i}".encode() for i in range(10)]
    _pickle_to(cifar_dir / "batches.meta", {b"label_names": names})
    assert load_cifar10(cifar_dir).classes == tuple(f"class{i}" for i in range(10))
    (cifar_dir / "batches.meta").unlink()
    assert load_cifar10(cifar_dir).classes == CIFAR10_CLASSES


def test_accepts_str_keys_and_python3_pickles(cifar_dir):
    ref = _expected()
    # Python 3 protocol 2 writes bytes as _codecs.encode(..., "latin1"); str keys; numpy 2 names.
    _pickle_to(cifar_dir / "test_batch", {"data": ref.test_x.reshape(N, 3072),
                                          "labels": ref.test_y.tolist()})
    np.testing.assert_array_equal(load_cifar10(cifar_dir).test_x, ref.test_x)
    # Protocol 5, labels as a numpy array.
    (cifar_dir / "test_batch").write_bytes(pickle.dumps(
        {b"data": ref.test_x.reshape(N, 3072), b"labels": ref.test_y}, protocol=5))
    np.testing.assert_array_equal(load_cifar10(cifar_dir).test_y, ref.test_y)


def test_accepts_numpy_1_module_names(cifar_dir):
    raw = (cifar_dir / "test_batch").read_bytes()
    assert b"numpy._core.multiarray\n_reconstruct" in raw
    (cifar_dir / "test_batch").write_bytes(
        raw.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n"))
    np.testing.assert_array_equal(load_cifar10(cifar_dir).test_x, _expected().test_x)


def test_load_dataset_dispatches(cifar_dir):
    ds = load_dataset("synthetic", seed=4, n_train=30, n_test=10)
    assert ds.name == "synthetic" and len(ds.train_y) == 30 and len(ds.test_y) == 10
    np.testing.assert_array_equal(ds.train_x, synthetic(30, 10, seed=4).train_x)
    assert len(load_dataset("synthetic").train_y) == 5000
    real = load_dataset(cifar_dir)
    _assert_same(real, _expected())
    part = load_dataset(str(cifar_dir), n_train=7, n_test=3)
    assert len(part.train_y) == 7 and len(part.test_y) == 3
    with pytest.raises(ValueError, match=r"n_train=1000, but .* has 100 images"):
        load_dataset(cifar_dir, n_train=1000)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 loader: bad files

def test_missing_directory(tmp_path):
    with pytest.raises(DataError, match=r"nope: does not exist; expected a cifar-10-batches-py"):
        load_cifar10(tmp_path / "nope")


def test_missing_batch_file(cifar_dir):
    (cifar_dir / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"data_batch_3: missing; expected the CIFAR-10 python"):
        load_cifar10(cifar_dir)


def test_missing_member_in_tar(tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/readme.html")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(DataError, match=r"member cifar-10-batches-py/data_batch_1 missing"):
        load_cifar10(archive)


def test_truncated_file(cifar_dir):
    path = cifar_dir / "data_batch_3"
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(DataError,
                       match=r"data_batch_3: not a readable CIFAR-10 pickle \(truncated"):
        load_cifar10(cifar_dir)


def test_truncated_tar(tmp_path):
    archive = write_cifar10(tmp_path, n_per_batch=N, as_tar=True)
    raw = archive.read_bytes()
    archive.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz"):
        load_cifar10(archive)


def test_not_a_pickle(cifar_dir):
    (cifar_dir / "test_batch").write_text("<html>404 Not Found</html>\n")
    with pytest.raises(DataError, match=r"test_batch: not a readable CIFAR-10 pickle"):
        load_cifar10(cifar_dir)


def test_not_a_tar(tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_text("not gzip")
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz: not a readable"):
        load_cifar10(archive)


class _RunsAShellCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_forbidden_global_is_refused_and_not_run(cifar_dir, tmp_path):
    marker = tmp_path / "pwned"
    _pickle_to(cifar_dir / "data_batch_1", {b"data": _RunsAShellCommand(marker), b"labels": []})
    refused = (r"data_batch_1: refusing to unpickle (os|posix|nt)\.system: "
               r"only plain containers and numpy arrays are allowed")
    with pytest.raises(DataError, match=refused):
        load_cifar10(cifar_dir)
    assert not marker.exists()


def test_forbidden_global_in_tar_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    raw = pickle.dumps({b"data": _RunsAShellCommand(marker)}, protocol=4)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    with pytest.raises(DataError,
                       match=r"data_batch_1: refusing to unpickle (os|posix|nt)\.system"):
        load_cifar10(archive)
    assert not marker.exists()


class _CodecsEncode:
    def __init__(self, encoding):
        self.encoding = encoding

    def __reduce__(self):
        import _codecs
        return (_codecs.encode, (b"x", self.encoding))


def test_codecs_encode_only_for_latin1(cifar_dir):
    # _codecs.encode is admitted for Python 3 bytes; any other codec is refused.
    _pickle_to(cifar_dir / "test_batch", {b"data": _CodecsEncode("hex")})
    with pytest.raises(DataError, match=r"test_batch: .*only allowed for latin1"):
        load_cifar10(cifar_dir)


@pytest.mark.parametrize("batch, message", [
    ([1, 2, 3], r"expected a pickled dict .* got list"),
    ({b"data": np.zeros((N, 3072), np.uint8)}, r"missing key\(s\) \['labels'\]"),
    ({b"data": np.zeros((N, 1024), np.uint8), b"labels": [0] * N},
     r"'data' must be N x 3072 \(R, G, B planes of 32x32\), got shape \(20, 1024\)"),
    ({b"data": np.zeros((N, 3, 32, 32), np.uint8), b"labels": [0] * N},
     r"'data' must be N x 3072 .* got shape \(20, 3, 32, 32\)"),
    ({b"data": np.zeros((N, 3072), np.float32), b"labels": [0] * N},
     r"'data' must be uint8, got float32"),
    ({b"data": [[0] * 3072] * N, b"labels": [0] * N}, r"'data' must be a numpy array"),
    ({b"data": np.zeros((N, 3072), np.uint8), b"labels": [0] * (N - 1) + [10]},
     r"label 10 out of range; expected 0..9"),
    ({b"data": np.zeros((N, 3072), np.uint8), b"labels": [-1] + [0] * (N - 1)},
     r"label -1 out of range; expected 0..9"),
    ({b"data": np.zeros((N, 3072), np.uint8), b"labels": [0] * (N - 1)},
     r"19 labels for 20 images; expected one label per row"),
    ({b"data": np.zeros((N, 3072), np.uint8), b"labels": ["cat"] * N},
     r"'labels' must be a flat list of ints 0..9"),
], ids=["not-dict", "no-labels", "rows-1024", "4d", "float", "list-data", "label-10",
        "label-neg", "count", "str-labels"])
def test_wrong_batch_contents(cifar_dir, batch, message):
    _pickle_to(cifar_dir / "data_batch_4", batch)
    with pytest.raises(DataError, match=r"data_batch_4: " + message):
        load_cifar10(cifar_dir)


def test_wrong_label_names(cifar_dir):
    _pickle_to(cifar_dir / "batches.meta", {b"label_names": [b"a", b"b"]})
    with pytest.raises(DataError, match=r"batches.meta: 'label_names' must be a list of 10 names"):
        load_cifar10(cifar_dir)


def test_data_set_repr_is_short(small):
    assert repr(small) == "DataSet('synthetic', train=200, test=50, classes=10)"
    assert isinstance(small, DataSet)


# ---- the restricted unpickler's bounds, opcode by opcode ------------------------------------------

def _load(raw: bytes):
    from hetconv.data.unpickle import restricted_load
    return restricted_load(io.BytesIO(raw), "f", "CIFAR-10", len(raw))


def test_the_unpickler_sizes_shared_references_at_each_use():
    inner = list(range(1000))
    assert _load(pickle.dumps([inner] * 100, protocol=2)) == [inner] * 100     # 100 x 8 kB: under the cap
    with pytest.raises(DataError, match=r"f: its containers expand to more than \d+ bytes .* from a file of \d+"):
        _load(pickle.dumps([inner] * 1000, protocol=2))                       # 8 MB from 2 kB of references
    nested = ()
    for _ in range(40):
        nested = (nested, nested)                # as a dict key, its hash would walk all 2**40 of it
    with pytest.raises(DataError, match=r"expand to more than"):
        _load(pickle.dumps([nested], protocol=2))


@pytest.mark.parametrize("raw, message", [
    # a list placed in another, then grown: counted small, walked large
    (b"\x80\x02]q\x00]q\x01h\x00ah\x00K\x01a.", r"changes a list after placing it in another"),
    (b"\x80\x02]q\x00h\x00a.", r"places a list inside itself"),
    # NEWOBJ on numpy.ndarray: an array of any shape, allocated unread
    (b"\x80\x02cnumpy\nndarray\nJ\x00\x00\x00@\x85\x81.", r"builds an object of a class \(NEWOBJ\)"),
    # _reconstruct asked for a shape other than numpy's (0,)
    (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\x00\x00@\x85C\x01b\x87R.",
     r"an array is rebuilt from shape \(0,\)"),
    # a plain void dtype whose state sets the flags of an object dtype
    (b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00V8\x89\x88\x87R(K\x03X\x01\x00\x00\x00|NNNK\x08K\x01K\x11tb.",
     r"a dtype's state marks it as holding Python objects"),
    (b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00O8\x89\x88\x87R.", r"dtype object holds Python objects"),
    (b"\x80\x05\x96\x00\x00\x00\x00\x01\x00\x00\x00.", r"declares a bytearray of 4294967296 bytes in a file of 12"),
    (b"\x80\x02B\x00\x00\x00\x40.", r"needs 1073741824 more bytes where 1 are left"),
], ids=["grown-after-use", "self", "newobj", "reconstruct-shape", "dtype-flags", "object-dtype", "bytearray8",
        "binbytes"])
def test_the_unpickler_refuses_what_no_data_file_needs(raw, message):
    with pytest.raises(DataError, match=r"^f: .*" + message):
        _load(raw)
