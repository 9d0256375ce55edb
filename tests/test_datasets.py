"""Data sets beyond CIFAR-10: CIFAR-100, MNIST-style IDX files (the bundled digits), an image folder,
a .npz; format detection; each set's own normalisation; augmentation and prefetched batches; and
LeNet-5 on the digits, trained by hetconv and by PyTorch from the same weights and batches."""
import gzip
import io
import json
import os
import shutil
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hetconv.cli import coordinator
from hetconv.training.config import Config
from hetconv.data import (CIFAR10_MEAN, CIFAR10_STD, DataError, augment, batches, load_dataset, normalize,
                          parse_augment, synthetic, test_batches)
from hetconv.data.idx import FASHION_CLASSES
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.training.loop import train

DIGITS = Path(__file__).parent / "data" / "digits"
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def quiet(*_):
    pass


def engine():
    return LocalEngine({"local": ConvShard(open_device("cpu", threads=1))})


def coordinator_says(capsys, *argv):
    """hetconv-coordinator in this process: exit status and its one line of stderr."""
    code = coordinator.main(["--local", "--steps", "1", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return code, err


# ---------------------------------------------------------------------------------------------
# MNIST IDX: the bundled digits

def test_the_digits_load_as_a_10_class_1x28x28_set():
    ds = load_dataset(DIGITS)
    assert ds.name == "mnist" and ds.classes == tuple("0123456789")
    assert ds.train_x.shape == (1437, 1, 28, 28) and ds.test_x.shape == (360, 1, 28, 28)
    assert ds.train_x.dtype == np.uint8 and ds.train_y.dtype == np.int64
    assert set(ds.train_y.tolist()) == set(range(10)) and set(ds.test_y.tolist()) == set(range(10))
    # 8x8 pixels repeated 3x3 inside a 2-pixel zero border
    assert not ds.train_x[:, :, :2].any() and not ds.train_x[:, :, :, -2:].any()
    block = ds.train_x[:, 0, 2:26, 2:26].reshape(-1, 8, 3, 8, 3)
    assert (block == block[:, :, :1, :, :1]).all()
    meta = ds.meta()
    assert meta["image_shape"] == [1, 28, 28] and meta["classes"] == list("0123456789")
    pixels = ds.train_x / 255.0
    np.testing.assert_allclose(meta["mean"], [pixels.mean()], atol=1e-5)
    np.testing.assert_allclose(meta["std"], [pixels.std()], atol=1e-5)


def _copy_idx(dest: Path, gunzip=False, **replace):
    """The digits' IDX files in `dest`, plain when gunzip; replace: file name -> bytes to write instead."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in IDX_NAMES:
        raw = gzip.decompress((DIGITS / f"{name}.gz").read_bytes())
        raw = replace.get(name, raw)
        if gunzip:
            (dest / name).write_bytes(raw)
        else:
            (dest / f"{name}.gz").write_bytes(gzip.compress(raw))
    return dest


def test_plain_idx_files_fashion_by_name_and_by_option(tmp_path):
    ref = load_dataset(DIGITS)
    plain = load_dataset(_copy_idx(tmp_path / "plain", gunzip=True))
    np.testing.assert_array_equal(plain.train_x, ref.train_x)
    np.testing.assert_array_equal(plain.test_y, ref.test_y)
    fashion = load_dataset(_copy_idx(tmp_path / "FashionMNIST" / "raw"))      # torchvision's layout
    assert fashion.name == "fashion-mnist" and fashion.classes == FASHION_CLASSES
    assert fashion.classes[9] == "Ankle boot"
    assert load_dataset(tmp_path / "FashionMNIST", fashion=False).classes == tuple("0123456789")
    assert load_dataset(tmp_path / "plain", fashion=True).name == "fashion-mnist"


def _idx(magic, dims, payload=b""):
    return struct.pack(">I", magic) + struct.pack(f">{len(dims)}I", *dims) + payload


@pytest.mark.parametrize("name,raw,message", [
    ("train-images-idx3-ubyte", _idx(0x801, (5,), bytes(5)),
     r"train-images-idx3-ubyte.gz: magic number 0x00000801; expected 0x00000803 \(IDX images"),
    ("t10k-labels-idx1-ubyte", _idx(0xD01, (360,), bytes(360)), r"t10k-labels-idx1-ubyte.gz: magic number 0x00000d01"),
    ("train-images-idx3-ubyte", _idx(0x803, (1437, 28, 28), bytes(100)),
     r"train-images-idx3-ubyte.gz: truncated: 100 of the 1126608 bytes"),
    ("t10k-labels-idx1-ubyte", _idx(0x801, (360,), bytes(361)), r"t10k-labels-idx1-ubyte.gz: more bytes than its header"),
    ("train-images-idx3-ubyte", _idx(0x803, (100000, 4096, 4096)),
     r"train-images-idx3-ubyte.gz: the header declares .* more than the 512 MB an IDX file may have: not read"),
    ("train-images-idx3-ubyte", _idx(0x803, (1437, 0, 28)), r"images of 0x28; expected rows and columns in 1\.\.4096"),
    ("train-labels-idx1-ubyte", _idx(0x801, (1436,), bytes(1436)),
     r"train-labels-idx1-ubyte.gz: 1436 labels for the 1437 images"),
    ("t10k-labels-idx1-ubyte", _idx(0x801, (360,), bytes([11]) * 360), r"t10k-labels-idx1-ubyte.gz: label 11 out of range"),
    ("t10k-images-idx3-ubyte", _idx(0x803, (360, 28, 27), bytes(360 * 28 * 27)),
     r"t10k-images-idx3-ubyte.gz: images of \(28, 27\); expected the training images' \(28, 28\)"),
    ("train-labels-idx1-ubyte", b"\x00\x00", r"train-labels-idx1-ubyte.gz: 2 bytes; expected an IDX header"),
], ids=["labels-as-images", "bad-magic", "truncated", "trailing", "huge-header", "zero-rows", "count",
        "label-11", "test-shape", "short"])
def test_bad_idx_files_are_refused_naming_the_file(tmp_path, name, raw, message):
    root = _copy_idx(tmp_path / "mnist", **{name: raw})
    with pytest.raises(DataError, match=message):
        load_dataset(root)


def test_a_missing_or_not_gzip_idx_file(tmp_path):
    root = _copy_idx(tmp_path / "mnist")
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: missing \(nor t10k-labels-idx1-ubyte.gz\)"):
        load_dataset(root)
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8bnot really gzip")
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte.gz: not a readable IDX file"):
        load_dataset(root)


# ---------------------------------------------------------------------------------------------
# CIFAR-100

def _cifar100_files(n_train=40, n_test=10, seed=0):
    rng = np.random.default_rng(seed)

    def split(n):
        fine = rng.integers(0, 100, n)
        return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"fine_labels": fine.tolist(),
                b"coarse_labels": (fine // 5).tolist(), b"filenames": [b"x.png"] * n, b"batch_label": b"b"}
    meta = {b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]}
    return {"train": split(n_train), "test": split(n_test), "meta": meta}


def write_cifar100(path: Path, as_tar=False, **files):
    files = {**_cifar100_files(), **files}
    path.mkdir(parents=True, exist_ok=True)
    if as_tar:
        archive = path / "cifar-100-python.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for name, obj in files.items():
                raw = pickle.dumps(obj, protocol=2)
                info = tarfile.TarInfo(f"cifar-100-python/{name}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
        return archive
    root = path / "cifar-100-python"
    root.mkdir()
    for name, obj in files.items():
        (root / name).write_bytes(pickle.dumps(obj, protocol=2))
    return root


@pytest.mark.parametrize("as_tar", [False, True], ids=["dir", "tar"])
def test_cifar100_fine_and_coarse_labels(tmp_path, as_tar):
    path = write_cifar100(tmp_path, as_tar=as_tar)
    ref = _cifar100_files()
    ds = load_dataset(path)
    assert ds.name == "cifar100" and len(ds.classes) == 100 and ds.classes[7] == "fine7"
    assert ds.train_x.shape == (40, 3, 32, 32)
    np.testing.assert_array_equal(ds.train_x.reshape(40, 3072), ref["train"][b"data"])
    np.testing.assert_array_equal(ds.test_y, ref["test"][b"fine_labels"])
    coarse = load_dataset(tmp_path, labels="coarse")                  # the directory holding it
    assert coarse.classes == tuple(f"coarse{i}" for i in range(20))
    np.testing.assert_array_equal(coarse.train_y, ref["train"][b"coarse_labels"])
    pixels = ds.train_x.transpose(1, 0, 2, 3).reshape(3, -1) / 255.0
    np.testing.assert_allclose(ds.mean, pixels.mean(1), atol=1e-5)     # its own statistics, not CIFAR-10's
    np.testing.assert_allclose(ds.std, pixels.std(1), atol=1e-5)


def test_cifar100_bad_contents_and_options(tmp_path):
    files = _cifar100_files()
    files["train"][b"coarse_labels"][3] = 20
    root = write_cifar100(tmp_path / "a", train=files["train"])
    with pytest.raises(DataError, match=r"cifar-100-python/train: label 20 out of range; expected 0\.\.19"):
        load_dataset(root, labels="coarse")
    with pytest.raises(DataError, match=r"labels='medium': expected 'fine' or 'coarse'"):
        load_dataset(root, labels="medium")
    del files["test"][b"fine_labels"]
    root = write_cifar100(tmp_path / "b", test=files["test"])
    with pytest.raises(DataError, match=r"cifar-100-python/test: missing key\(s\) \['fine_labels'\]"):
        load_dataset(root)
    with pytest.raises(DataError, match=r"applies to CIFAR-100 only"):
        load_dataset(DIGITS, labels="coarse")


def test_cifar100_refuses_a_forbidden_global(tmp_path):
    class RunsACommand:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    root = write_cifar100(tmp_path, as_tar=True, train={b"data": RunsACommand()})
    with pytest.raises(DataError, match=r"cifar-100-python/train: refusing to unpickle (os|posix|nt)\.system"):
        load_dataset(root)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------------------------
# An image folder

Image = pytest.importorskip("PIL.Image", reason="the image folder needs Pillow (pip install 'hetconv[images]')")


def write_image_folder(root: Path, classes=("cat", "ant", "bee"), per_class=(6, 2), size=(12, 10), mode="RGB"):
    """root/train/<class>/<i>.png and root/test/...; returns {file: pixels (C, H, W)}."""
    rng = np.random.default_rng(1)
    written = {}
    for split, count in zip(("train", "test"), per_class):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(count):
                shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
                pixels = rng.integers(0, 256, shape, dtype=np.uint8)
                path = root / split / c / f"{i}.png"
                Image.fromarray(pixels, mode).save(path)
                written[path] = pixels.reshape(size[1], size[0], -1).transpose(2, 0, 1)
    return written


def test_an_image_folder_numbers_classes_in_sorted_order(tmp_path):
    written = write_image_folder(tmp_path / "pets")
    ds = load_dataset(tmp_path / "pets")
    assert ds.classes == ("ant", "bee", "cat") and ds.name == "pets"
    assert ds.train_x.shape == (18, 3, 10, 12) and ds.test_x.shape == (6, 3, 10, 12)
    assert ds.train_y.tolist() == [0] * 6 + [1] * 6 + [2] * 6
    np.testing.assert_array_equal(ds.train_x[6], written[tmp_path / "pets/train/bee/0.png"])
    np.testing.assert_array_equal(ds.test_x[5], written[tmp_path / "pets/test/cat/1.png"])
    write_image_folder(tmp_path / "gray", mode="L")
    gray = load_dataset(tmp_path / "gray")
    assert gray.train_x.shape == (18, 1, 10, 12) and gray.meta()["image_shape"] == [1, 10, 12]


def test_an_image_folder_refuses_a_mix_of_sizes_naming_the_first_odd_file(tmp_path):
    write_image_folder(tmp_path / "a")
    Image.new("RGB", (13, 10)).save(tmp_path / "a/train/bee/3.png")
    with pytest.raises(DataError, match=r"a/train/bee/3.png: 13x10; expected every image 12x10, as .*a/train/ant/0.png"):
        load_dataset(tmp_path / "a")
    write_image_folder(tmp_path / "b", mode="L")
    Image.fromarray(np.zeros((10, 12), np.uint16)).save(tmp_path / "b/test/ant/1.png")     # 16-bit grey
    with pytest.raises(DataError, match=r"b/test/ant/1.png: mode I;16; expected 8 bits a channel"):
        load_dataset(tmp_path / "b")


def test_an_image_folder_converts_modes_as_torchvision_does(tmp_path):
    """torchvision's ImageFolder loads every image with convert("RGB"): RGBA loses its alpha, a
    palette is expanded, grey is repeated; a folder that is all grey stays one channel."""
    write_image_folder(tmp_path / "a")
    rng = np.random.default_rng(3)
    odd = {"train/ant/0.png": Image.fromarray(rng.integers(0, 256, (10, 12, 4), dtype=np.uint8), "RGBA"),
           "train/bee/1.png": Image.fromarray(rng.integers(0, 256, (10, 12), dtype=np.uint8), "L"),
           "test/cat/0.png": Image.fromarray(rng.integers(0, 256, (10, 12, 2), dtype=np.uint8), "LA"),
           "test/ant/1.png": Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).convert("P")}
    for name, image in odd.items():
        image.save(tmp_path / "a" / name)
    ds = load_dataset(tmp_path / "a")
    assert ds.train_x.shape == (18, 3, 10, 12)
    for name, image in odd.items():
        split, cls, file = name.split("/")
        x = ds.train_x if split == "train" else ds.test_x
        position = ds.classes.index(cls) * (6 if split == "train" else 2) + int(file[0])
        with Image.open(tmp_path / "a" / name) as reread:
            np.testing.assert_array_equal(x[position], np.asarray(reread.convert("RGB")).transpose(2, 0, 1), name)
    write_image_folder(tmp_path / "grey", mode="L")
    Image.fromarray(rng.integers(0, 256, (10, 12, 2), dtype=np.uint8), "LA").save(tmp_path / "grey/train/ant/0.png")
    grey = load_dataset(tmp_path / "grey")
    assert grey.train_x.shape == (18, 1, 10, 12)
    with Image.open(tmp_path / "grey/train/ant/0.png") as reread:
        np.testing.assert_array_equal(grey.train_x[0, 0], np.asarray(reread.convert("L")))


def test_an_image_folder_refuses_bad_files_and_layouts(tmp_path):
    write_image_folder(tmp_path / "a")
    (tmp_path / "a/train/cat/2.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"a/train/cat/2.png: not a readable PNG or JPEG image"):
        load_dataset(tmp_path / "a")
    write_image_folder(tmp_path / "b")
    (tmp_path / "b/test/dog").mkdir()
    with pytest.raises(DataError, match=r"b/test/dog: class 'dog' is not among the 3 classes"):
        load_dataset(tmp_path / "b")
    write_image_folder(tmp_path / "c")
    for f in (tmp_path / "c/train/ant").iterdir():
        f.unlink()
    with pytest.raises(DataError, match=r"c/train/ant: no images; expected"):
        load_dataset(tmp_path / "c")


def test_an_image_folder_without_pillow_names_the_extra(tmp_path, monkeypatch):
    write_image_folder(tmp_path / "a")
    monkeypatch.setitem(sys.modules, "PIL", None)                     # import PIL fails as if absent
    with pytest.raises(DataError, match=r"a: an image folder is read with Pillow, .*pip install 'hetconv\[images\]'"):
        load_dataset(tmp_path / "a")


# ---------------------------------------------------------------------------------------------
# .npz

def _npz(path, **arrays):
    rng = np.random.default_rng(2)
    base = {"x_train": rng.integers(0, 256, (12, 8, 8, 3), dtype=np.uint8), "y_train": np.arange(12) % 4,
            "x_test": rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8), "y_test": np.arange(4)}
    np.savez(path, **{**base, **arrays})
    return path, base


def test_npz_layouts_and_dtypes(tmp_path):
    path, base = _npz(tmp_path / "nhwc.npz")
    ds = load_dataset(path)
    assert ds.name == "nhwc" and ds.classes == ("0", "1", "2", "3") and ds.train_x.shape == (12, 3, 8, 8)
    np.testing.assert_array_equal(ds.train_x, base["x_train"].transpose(0, 3, 1, 2))
    nchw = base["x_train"].transpose(0, 3, 1, 2)
    ds2 = load_dataset(_npz(tmp_path / "nchw.npz", x_train=nchw / 255.0,
                            x_test=base["x_test"].transpose(0, 3, 1, 2).astype(np.float32) / 255,
                            classes=np.array(["a", "b", "c", "d", "e"]))[0])
    np.testing.assert_array_equal(ds2.train_x, ds.train_x)             # floats in [0, 1] back to the same bytes
    assert ds2.classes == ("a", "b", "c", "d", "e")
    gray = load_dataset(_npz(tmp_path / "gray.npz", x_train=base["x_train"][..., 0], x_test=base["x_test"][..., 0],
                             y_train=(np.arange(12) % 4).reshape(12, 1))[0])
    assert gray.train_x.shape == (12, 1, 8, 8) and gray.train_y.tolist() == (np.arange(12) % 4).tolist()


@pytest.mark.parametrize("arrays,message", [
    ({"x_train": np.zeros((12, 3, 8, 3), np.uint8)}, r"x_train of shape \(12, 3, 8, 3\) is ambiguous"),
    ({"x_train": np.zeros((12, 5, 8, 8), np.uint8)}, r"x_train of shape \(12, 5, 8, 8\); expected \(N, C, H, W\)"),
    ({"x_test": np.full((4, 8, 8, 3), 1.5)}, r"x_test has values outside \[0, 1\]"),
    ({"x_test": np.zeros((4, 8, 8, 3), np.int32)}, r"x_test is int32; expected uint8 images or float"),
    ({"x_test": np.zeros((4, 9, 8, 3), np.uint8)}, r"x_test images are \(3, 9, 8\), x_train's \(3, 8, 8\)"),
    ({"y_test": np.array([0, 1, 2, -1])}, r"y_test: label -1 out of range"),
    ({"y_train": np.arange(11)}, r"11 labels in y_train for 12 images"),
    ({"y_train": np.zeros(12, np.float32)}, r"y_train is float32 of shape \(12,\); expected a flat array of ints"),
    ({"classes": np.array(["a", "b"])}, r"y_train: label 2 out of range; expected 0\.\.1"),
], ids=["ambiguous", "no-channels", "float-range", "int-images", "shapes", "negative", "count", "float-labels",
        "few-names"])
def test_bad_npz_contents(tmp_path, arrays, message):
    path, _ = _npz(tmp_path / "d.npz", **arrays)
    with pytest.raises(DataError, match=r"d.npz: " + message):
        load_dataset(path)


def test_npz_refuses_objects_missing_arrays_and_huge_headers(tmp_path):
    path, _ = _npz(tmp_path / "obj.npz", y_test=np.array([0, 1, "two", None], dtype=object))
    with pytest.raises(DataError, match=r"obj.npz: y_test holds Python objects"):
        load_dataset(path)
    np.savez(tmp_path / "few.npz", x_train=np.zeros((2, 8, 8), np.uint8))
    with pytest.raises(DataError, match=r"few.npz: missing y_train, x_test, y_test; expected arrays"):
        load_dataset(tmp_path / "few.npz")
    # x_train's header declares 100000 images of 4096x4096x3 (4.6 TiB); the data after it is 12 small ones
    path, _ = _npz(tmp_path / "huge.npz")
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    assert b"(12, 8, 8, 3)" in members["x_train.npy"]
    members["x_train.npy"] = members["x_train.npy"].replace(b"(12, 8, 8, 3)", b"(100000, 4096, 4096, 3)")
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(DataError, match=r"huge.npz: x_train is \(100000, 4096, 4096, 3\) uint8 = \d+ bytes, more than"):
        load_dataset(path)


# ---------------------------------------------------------------------------------------------
# Detection and the command line

def test_anything_else_is_refused_with_one_line_naming_the_accepted_forms(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    for path, what in ((tmp_path / "nope", "does not exist"), (tmp_path / "notes.txt", "a file of no known"),
                       (tmp_path / "empty", "a directory of no known")):
        with pytest.raises(DataError) as info:
            load_dataset(path)
        text = str(info.value)
        assert text.startswith(f"{path}: {what}") and "\n" not in text
        assert "CIFAR-100" in text and "IDX" in text and "image folder" in text and ".npz" in text


def test_the_command_line_turns_bad_data_into_one_line_and_status_2(tmp_path, capsys):
    root = _copy_idx(tmp_path / "mnist", **{"train-labels-idx1-ubyte": _idx(0x803, (1437,), bytes(1437))})
    code, err = coordinator_says(capsys, "--data", root)
    assert code == 2 and "train-labels-idx1-ubyte.gz: magic number 0x00000803; expected 0x00000801" in err
    (tmp_path / "x.npz").write_bytes(b"PK\x03\x04 truncated")
    code, err = coordinator_says(capsys, "--data", tmp_path / "x.npz")
    assert code == 2 and "x.npz: not a readable .npz" in err


# ---------------------------------------------------------------------------------------------
# Normalisation, augmentation, prefetching

def test_batches_are_normalised_with_the_data_sets_own_statistics():
    ds = load_dataset(DIGITS)
    x = np.concatenate([x for x, _ in batches(ds, 479, None, shuffle=False)])         # all 1437, in order
    assert abs(x.mean()) < 1e-4 and abs(x.std() - 1) < 1e-4
    np.testing.assert_allclose(next(test_batches(ds, 8))[0], ds.normalize(ds.test_x[:8]))
    # the synthetic set and CIFAR-10 keep CIFAR-10's published statistics
    syn = synthetic(40, 8, seed=1)
    assert syn.meta()["mean"] == list(CIFAR10_MEAN) and syn.meta()["std"] == list(CIFAR10_STD)
    np.testing.assert_array_equal(next(batches(syn, 8, None, shuffle=False))[0], normalize(syn.train_x[:8]))


def test_augment_crop_keeps_shapes_and_shifts_within_the_padding():
    x = np.random.default_rng(0).integers(1, 256, (64, 3, 10, 12), dtype=np.uint8)    # no zero pixel
    out = augment(x, np.random.default_rng(1), crop_padding=4, flip=False)
    assert out.shape == x.shape and out.dtype == np.uint8
    shifts = set()
    for img, crop in zip(x, out):
        padded = np.pad(img, ((0, 0), (4, 4), (4, 4)))
        found = [(dy, dx) for dy in range(9) for dx in range(9)
                 if np.array_equal(padded[:, dy:dy + 10, dx:dx + 12], crop)]
        assert found, "a crop is a window of the zero-padded image"
        shifts.add(found[0])
    assert len(shifts) > 20                                            # the offsets vary


def test_augment_flip_is_a_flip():
    x = np.random.default_rng(0).integers(0, 256, (200, 1, 6, 7), dtype=np.uint8)
    out = augment(x, np.random.default_rng(3), crop_padding=0, flip=True)
    same = np.array([np.array_equal(a, b) for a, b in zip(x, out)])
    mirrored = np.array([np.array_equal(a[..., ::-1], b) for a, b in zip(x, out)])
    assert (same | mirrored).all() and 60 < mirrored.sum() < 140
    np.testing.assert_array_equal(augment(x, np.random.default_rng(3), crop_padding=0, flip=False), x)


def test_augmented_batches_depend_only_on_seed_epoch_and_step():
    ds = synthetic(96, 8, seed=0)

    def epoch_batches(seed, epoch, **kw):
        return [(x.copy(), y) for x, y in batches(ds, 16, np.random.default_rng([seed, epoch]),
                                                 augment=("crop", "flip"), seed=seed, epoch=epoch, **kw)]
    a, b = epoch_batches(0, 0), epoch_batches(0, 0)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    plain = [x for x, _ in batches(ds, 16, np.random.default_rng([0, 0]))]
    assert all(x.shape == p.shape for (x, _), p in zip(a, plain))
    assert not np.array_equal(a[0][0], plain[0])                       # augmented
    # another epoch with the same order still draws other crops
    other = [x for x, _ in batches(ds, 16, np.random.default_rng([0, 0]), augment=("crop", "flip"), seed=0, epoch=1)]
    assert not np.array_equal(a[0][0], other[0])
    # a run resumed at batch 3 sees what an uninterrupted one saw
    for (xa, ya), (xs, ys) in zip(a[3:], epoch_batches(0, 0, start=3)):
        np.testing.assert_array_equal(xa, xs)
        np.testing.assert_array_equal(ya, ys)


@pytest.mark.parametrize("augmentation", [(), ("crop", "flip")])
def test_prefetching_yields_exactly_what_the_plain_iterator_yields(augmentation):
    ds = load_dataset(DIGITS)
    kw = dict(augment=augmentation, seed=5, epoch=2, drop_last=False)
    plain = list(batches(ds, 100, np.random.default_rng(7), **kw))
    ahead = list(batches(ds, 100, np.random.default_rng(7), prefetch=True, **kw))
    assert len(plain) == len(ahead) == 15
    for (xp, yp), (xa, ya) in zip(plain, ahead):
        np.testing.assert_array_equal(xp, xa)
        np.testing.assert_array_equal(yp, ya)
    started = batches(ds, 100, np.random.default_rng(7), prefetch=True, **kw)
    next(started)
    started.close()                                                    # stopping early leaves no thread behind


def test_parse_augment():
    assert parse_augment("crop,flip") == ("crop", "flip") and parse_augment("flip") == ("flip",)
    assert parse_augment("none") == () and parse_augment("") == ()
    with pytest.raises(ValueError, match=r"--augment 'crop,rotate': expected a comma-separated list of crop, flip"):
        parse_augment("crop,rotate")
    with pytest.raises(ValueError, match=r"augment=\('mirror',\): 'mirror' is not one of crop, flip"):
        next(batches(synthetic(16, 4), 8, None, shuffle=False, augment=("mirror",)))


# ---------------------------------------------------------------------------------------------
# End to end

def test_a_tiny_cifar100_archive_an_image_folder_and_a_photo_folder_train_end_to_end(tmp_path):
    from test_photos import write_photos
    archive = write_cifar100(tmp_path / "c100", as_tar=True)
    write_image_folder(tmp_path / "pets", size=(32, 32))
    write_photos(tmp_path / "photos", per_class=(6, 2))
    photos = dict(image_size=32, augment="random-resized-crop,flip", loader_workers=1, eval_every=1,
                  metrics=str(tmp_path / "m.jsonl"))
    for data, classes, extra in ((archive, 100, {}), (tmp_path / "pets", 3, {}), (tmp_path / "photos", 3, photos)):
        cfg = Config(net="lenet5", data=str(data), batch_size=8, steps=2, threads=1, rebalance_after=0,
                     **extra).validate()
        lines = []
        summary = train(cfg, engine(), log=lines.append)
        assert summary["step"] == 2 and len(summary["losses"]) == 2 and np.isfinite(summary["losses"]).all()
        assert summary["losses"][0] == pytest.approx(np.log(classes), rel=0.2)     # a fresh head: about chance
    # the photos streamed through a loader process, evaluated on val/ (the eval transform)
    assert any(line.startswith("photo loader: 1 process (--loader-workers)") for line in lines), lines
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["data_wait_s"] >= 0 for r in records if r["event"] == "step"] == [True, True]
    assert [r["test_images"] for r in records if r["event"] == "eval"] == [6]


def test_lenet5_learns_the_digits_as_pytorch_does_from_the_same_weights_and_batches(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")
    from hetconv.net import LoadedNet, load_net
    from hetconv.net.torch_import import to_torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ds = load_dataset(DIGITS)
    spec = load_net("lenet5", ds.image_shape, len(ds.classes)).spec
    conv, fc = spec.init_params(np.random.default_rng(11))
    module = to_torch(spec, conv, fc)                                 # a copy: hetconv updates its own arrays
    epochs, batch, lr, momentum = 6, 32, 0.02, 0.9
    cfg = Config(net="lenet5", data=str(DIGITS), batch_size=batch, epochs=epochs, lr=lr, momentum=momentum,
                 weight_decay=0.0, threads=1, rebalance_after=0, eval_every=0, seed=3,
                 checkpoint_dir=str(tmp_path / "ck"), metrics=str(tmp_path / "m.jsonl")).validate()
    summary = train(cfg, engine(), log=quiet, dataset=ds, network=LoadedNet(spec, (conv, fc)))
    # hetconv-eval on the run's checkpoint says what the run's last eval record says
    last_eval = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"event": "eval"' in line][-1]
    evaluated = subprocess.run([sys.executable, "-m", "hetconv.cli.evaluate", str(tmp_path / "ck"), "--json"],
                               capture_output=True, text=True, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["accuracy"] == last_eval["test_accuracy"] == summary["test_accuracy"]

    # PyTorch: the same batches in the same order (train() shuffles epoch e with rng [seed, e])
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    torch_losses = []
    for epoch in range(epochs):
        for x, y in batches(ds, batch, np.random.default_rng([cfg.seed, epoch])):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            opt.step()
            torch_losses.append(loss.item())
    with torch.no_grad():
        logits = torch.cat([module(torch.from_numpy(x)) for x, _ in test_batches(ds, 120)]).numpy()
    theirs = float(np.mean(logits.argmax(1) == ds.test_y))
    ours = summary["test_accuracy"]
    assert summary["step"] == epochs * (len(ds.train_y) // batch) and summary["test_images"] == 360
    # step for step the same training while float rounding has not yet sent the two apart: hetconv
    # on OpenBLAS and on oneDNN agree with each other to 1e-7 in the loss through step 155 and then
    # part (1e-4 at step 156, the loss by then near 0.07), so the first 100 steps are held to 1e-4
    np.testing.assert_allclose(summary["losses"][:100], torch_losses[:100], rtol=1e-4)
    assert ours >= 0.95, f"hetconv LeNet-5 on the digits: test accuracy {ours:.3f}"
    # two runs that parted by rounding land a few test images apart (PyTorch 97.8% and hetconv on
    # oneDNN's GEMMs 95.3% on this test set of 360, where one image is 0.28 points)
    assert abs(ours - theirs) <= 0.03, f"hetconv {ours:.3f}, PyTorch {theirs:.3f} from the same weights and batches"


# ---------------------------------------------------------------------------------------------
# Labels, a held-out test split, the Fashion-MNIST name

def test_npz_classes_inferred_from_labels_must_each_have_a_training_image(tmp_path):
    path, _ = _npz(tmp_path / "gap.npz", y_train=np.array([0, 1, 2, 3] * 2 + [250] * 4))
    with pytest.raises(DataError, match=r"gap.npz: no `classes` array, and the labels up to 250 imply 251 classes, "
                                        r"but only 5 distinct labels have training images \(none for 4, 5, 6"):
        load_dataset(path)
    path, _ = _npz(tmp_path / "test-only.npz", y_test=np.array([0, 1, 2, 4]))     # 4: in no training image
    with pytest.raises(DataError, match=r"imply 5 classes, but only 4 distinct labels .*none for 4\)"):
        load_dataset(path)
    stray = np.array([i % 4 for i in range(11)] + [4])                         # 0..3 about three times each, one 4
    rng = np.random.default_rng(0)
    path, _ = _npz(tmp_path / "stray.npz", y_train=stray)
    ds = load_dataset(path)
    assert ds.classes == ("0", "1", "2", "3", "4")
    assert ds.notes == (f"{path}: no `classes` array: 5 classes inferred from the labels 0..4",)
    many = np.array([i % 4 for i in range(800)] + [4])                         # 200 each, one 4: under 1%
    x = rng.integers(0, 256, (801, 8, 8, 3), dtype=np.uint8)
    path, _ = _npz(tmp_path / "rare.npz", x_train=x, y_train=many)
    assert load_dataset(path).notes[0].endswith("5 classes inferred from the labels 0..4; class 4 has 1 training "
                                                "image(s) against 200 for the largest (a stray label?)")
    path, _ = _npz(tmp_path / "named.npz", y_train=stray, classes=np.array(list("abcd")))
    with pytest.raises(DataError, match=r"named.npz: y_train: label 4 out of range; expected 0\.\.3 \(the data "
                                        r"set's 4 classes\)"):
        load_dataset(path)


def test_val_split_holds_out_part_of_train_for_a_set_with_no_test_split(tmp_path):
    write_image_folder(tmp_path / "pets", per_class=(10, 1))
    shutil.rmtree(tmp_path / "pets" / "test")
    with pytest.raises(DataError, match=r"pets: no test split .*give --val-split FRACTION"):
        load_dataset(tmp_path / "pets")
    ds = load_dataset(tmp_path / "pets", seed=3, val_split=0.2)
    assert len(ds.train_y) == 24 and len(ds.test_y) == 6                       # 2 of each class's 10
    assert np.bincount(ds.test_y).tolist() == [2, 2, 2]
    assert ds.notes == (f"{tmp_path / 'pets'}: no test split; --val-split 0.2 held out 6 of the 30 training images "
                        f"(per class, seed 3) as the test split",)
    again, other = load_dataset(tmp_path / "pets", seed=3, val_split=0.2), load_dataset(tmp_path / "pets", seed=4,
                                                                                        val_split=0.2)
    np.testing.assert_array_equal(again.test_x, ds.test_x)                     # the seed decides, nothing else
    assert not np.array_equal(other.test_x, ds.test_x)
    whole = load_dataset(_npz(tmp_path / "x.npz")[0])
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "train-only.npz", x_train=rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8),
             y_train=np.arange(20) % 2)
    assert len(load_dataset(tmp_path / "train-only.npz", val_split=0.5).test_y) == 10
    for spec in (tmp_path / "x.npz", "synthetic", DIGITS):
        with pytest.raises(DataError, match=r"--val-split applies to a data set with no test split"):
            load_dataset(spec, val_split=0.1)
    assert len(whole.test_y) == 4
    with pytest.raises(DataError, match=r"holds out 0; expected at least one image in each split"):
        load_dataset(tmp_path / "pets", val_split=0.01)
    with pytest.raises(ValueError, match=r"--val-split must be in \[0, 1\), got 1.0"):
        Config(val_split=1.0).validate()


def test_val_split_trains_and_evaluates_on_the_same_held_out_images(tmp_path, capsys):
    write_image_folder(tmp_path / "pets", per_class=(10, 1), size=(16, 16))
    shutil.rmtree(tmp_path / "pets" / "test")
    code = coordinator.main(["--local", "--data", str(tmp_path / "pets"), "--val-split", "0.2", "--net", "lenet5",
                             "--batch-size", "8", "--steps", "2", "--threads", "1",
                             "--checkpoint-dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "--val-split 0.2 held out 6 of the 30 training images (per class, seed 0) as the test split" in out.out
    from hetconv.training import trained_model
    model = trained_model.load_model(str(tmp_path / "ckpt"))
    held = trained_model.load_test_data(model)
    np.testing.assert_array_equal(held.test_x, load_dataset(tmp_path / "pets", val_split=0.2).test_x)


def test_fashion_is_told_by_the_data_sets_own_directory_only(tmp_path):
    parent = tmp_path / "fashion-experiments"
    assert load_dataset(_copy_idx(parent / "mnist")).name == "mnist"          # a parent's name says nothing
    assert load_dataset(_copy_idx(parent / "FashionMNIST" / "raw")).name == "fashion-mnist"
    assert load_dataset(parent / "FashionMNIST" / "raw").name == "fashion-mnist"   # raw/ itself: its parent's name
    assert load_dataset(_copy_idx(tmp_path / "digits" / "raw")).name == "mnist"
