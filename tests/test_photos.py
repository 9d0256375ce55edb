"""Photo folders (ImageNet's layout, photos of any size, streamed): the listing and its bad files,
torchvision's transforms, the loader processes and hetconv-data. Folders are a few tiny photos
written here, one bad file a test."""
import math
import os

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image", reason="photo folders are an optional extra (pip install 'hetconv[images]')")

from hetconv.data import DataError, load_dataset  # noqa: E402
from hetconv.data import photos  # noqa: E402
from hetconv.data.photos import (eval_image, random_resized_box, resize_box, train_batch)  # noqa: E402
from hetconv.training.config import Config  # noqa: E402

CLASSES = ("cat", "dog", "eel")


def write_photos(root, per_class=(4, 2), split="val", seed=0, size_range=(18, 60)):
    """ROOT/train/<class>/ and ROOT/<split>/<class>/: photos of random sizes and formats (JPEG,
    PNG, WebP; RGB, grey, palette, RGBA). Returns the paths written, in listing order."""
    rng = np.random.default_rng(seed)
    written = []
    for name, count in zip(("train", split), per_class):
        for c in CLASSES:
            os.makedirs(root / name / c)
            for i in range(count):
                w, h = (int(v) for v in rng.integers(*size_range, 2))
                image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                kind = i % 4
                if kind == 0:
                    path = root / name / c / f"{i}.jpg"
                    image.save(path, quality=90)
                elif kind == 1:
                    path = root / name / c / f"{i}.png"
                    image.convert("L").save(path)
                elif kind == 2:
                    path = root / name / c / f"{i}.webp"
                    image.save(path)
                else:
                    path = root / name / c / f"{i}.png"
                    image.convert("P").save(path)
                written.append(str(path))
    return written


def reference_eval(path, size):
    """torchvision's Resize(round(size / 0.875)) then CenterCrop(size), step by step in Pillow."""
    resize = round(size / 0.875)
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        rw, rh = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
        im = im.resize((rw, rh), Image.BILINEAR)
        top, left = int(round((rh - size) / 2.0)), int(round((rw - size) / 2.0))
        return np.asarray(im.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


def test_a_photo_folder_lists_as_image_folder_and_evaluates_as_torchvision(tmp_path, monkeypatch):
    written = write_photos(tmp_path / "pets")
    (tmp_path / "pets/train/cat/3.png").write_bytes(b"")              # a bad file, found in a scan process
    monkeypatch.setattr(photos, "PARALLEL_SCAN", 2)                    # headers checked in processes
    monkeypatch.setattr(photos, "SCAN_CHUNK", 5)
    with pytest.raises(DataError, match=r"1 bad file .*cat/3.png: an empty file"):
        load_dataset(tmp_path / "pets", image_size=16)
    monkeypatch.undo()
    Image.new("P", (20, 30)).save(tmp_path / "pets/train/cat/3.png")
    written[3] = str(tmp_path / "pets/train/cat/3.png")
    ds = load_dataset(tmp_path / "pets", image_size=16)
    assert ds.classes == CLASSES and ds.name == "pets" and ds.image_shape == (3, 16, 16)
    assert ds.train_y.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and ds.test_y.tolist() == [0, 0, 1, 1, 2, 2]
    assert ds.train_x.files == written[:12] and ds.test_x.files == written[12:]
    assert ds.mean == photos.IMAGENET_MEAN and ds.meta()["photos"] == {"image_size": 16, "eval_resize": 18}
    x = ds.test_x[0:6]                                       # decoded now, with evaluation's transform
    assert x.shape == (6, 3, 16, 16) and x.dtype == np.uint8
    # one resize of the crop's box is a resize then a crop, to a rounding step (1 of 255); the JPEG
    # decoded whole, as torchvision does (its reduced-scale decode: the test after the next)
    monkeypatch.setattr(photos, "_draft_scale", lambda box, size: 1)
    for i in range(4):                                       # JPEG, PNG grey, WebP, PNG palette
        diff = ds.train_x[i].astype(int) - reference_eval(ds.train_x.files[i], 16)
        assert np.abs(diff).max() <= 1 and np.abs(diff).mean() < 0.5, ds.train_x.files[i]


def test_resize_and_center_crop_boxes_are_torchvisions():
    # Resize(256) of 500x375 is 341x256; CenterCrop(224) starts at round(58.5) = 58, round(16) = 16
    left, top, right, bottom = resize_box(500, 375, 256, 224)
    assert (left, top) == pytest.approx((58 * 500 / 341, 16 * 375 / 256))
    assert (right - left, bottom - top) == pytest.approx((224 * 500 / 341, 224 * 375 / 256))
    rng = np.random.default_rng(0)
    for _ in range(200):
        w, h = (int(v) for v in rng.integers(20, 400, 2))
        l, t, r, b = random_resized_box(w, h, rng)
        assert 0 <= l < r <= w and 0 <= t < b <= h
        area = (r - l) * (b - t) / (w * h)
        if (r - l, b - t) != (w, h):
            assert 0.07 <= area <= 1.0 and 3 / 4 - 0.1 <= (r - l) / (b - t) <= 4 / 3 + 0.1
    # ten tries cannot fit a strip: the center crop, clamped to ratio 4/3
    assert random_resized_box(1000, 10, rng) == (493, 0, 506, 10)
    assert random_resized_box(10, 1000, rng) == (0, 493, 10, 506)


def test_training_batches_depend_only_on_seed_epoch_and_position(tmp_path):
    write_photos(tmp_path / "pets", per_class=(3, 1))
    files = load_dataset(tmp_path / "pets", image_size=12).train_x.files
    augment = ("random-resized-crop", "flip", "crop")
    a = train_batch(files[:4], 12, augment, seed=1, epoch=2, first=8)
    b = train_batch(files[2:4], 12, augment, seed=1, epoch=2, first=10)
    np.testing.assert_array_equal(a[2:], b)
    assert not np.array_equal(a, train_batch(files[:4], 12, augment, seed=1, epoch=3, first=8))
    plain = train_batch(files[:1], 12, (), seed=0, epoch=0, first=0)      # Resize(12), CenterCrop(12)
    big = photos.decode(files[0], 12, lambda w, h: resize_box(w, h, 12, 12))
    np.testing.assert_array_equal(plain[0], big)


def test_a_large_jpeg_is_decoded_at_reduced_scale_close_to_a_full_decode(tmp_path):
    rng = np.random.default_rng(1)
    smooth = np.kron(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8), np.ones((16, 16, 1), np.uint8))
    Image.fromarray(smooth).save(tmp_path / "big.jpg", quality=95)          # 640x480
    box_of = lambda w, h: resize_box(w, h, 73, 64)                          # noqa: E731
    fast = photos.decode(str(tmp_path / "big.jpg"), 64, box_of).astype(int)
    full = photos.decode(str(tmp_path / "big.jpg"), 64, box_of, draft=False).astype(int)
    assert np.abs(fast - full).mean() < 4


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
def test_a_jpeg_with_odd_sides_is_decoded_at_reduced_scale_by_either_decoder_to_the_same_pixels(tmp_path, monkeypatch,
                                                                                               decoder):
    """Pillow's draft divides each side by the size asked for and rounds down, so the sides asked
    for are rounded down: a 641x481 photo is decoded at 1/2 and 1/4 (321x241, 161x121), not whole.
    simplejpeg, where installed, decodes the same pixels (the same libjpeg-turbo and settings);
    a grey JPEG too, and a CMYK one is left to Pillow."""
    if decoder == "simplejpeg":
        pytest.importorskip("simplejpeg", reason="the fast-jpeg extra is not installed (pip install 'hetconv[fast-jpeg]')")
    else:
        monkeypatch.setattr(photos, "_simplejpeg", [None])
    rng = np.random.default_rng(2)
    smooth = np.kron(rng.integers(0, 256, (31, 41, 3), dtype=np.uint8), np.ones((16, 16, 1), np.uint8))[:481, :641]
    Image.fromarray(smooth).save(tmp_path / "odd.jpg", quality=90)
    Image.fromarray(smooth).convert("L").save(tmp_path / "grey.jpg", quality=90)
    Image.fromarray(smooth).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=90)
    for name, size, scale in (("odd", 64, 4), ("odd", 150, 2), ("grey", 64, 4), ("cmyk", 64, 4), ("odd", 300, 1)):
        box = (10.5, 20.0, 600.25, 470.0)
        with Image.open(tmp_path / f"{name}.jpg") as im:
            im.draft("RGB", (641 // scale, 481 // scale))
            assert im.size == (math.ceil(641 / scale), math.ceil(481 / scale))
            f = im.size[0] / 641, im.size[1] / 481
            want = np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR,
                                                       box=(box[0] * f[0], box[1] * f[1], box[2] * f[0], box[3] * f[1])))
        got = photos.decode(str(tmp_path / f"{name}.jpg"), size, lambda w, h: box)
        np.testing.assert_array_equal(got, want.transpose(2, 0, 1), err_msg=f"{name} at {size}")


def test_the_compiled_resize_is_pillows_horizontal_pass_then_its_vertical_pass():
    """hetconv.data.resample on random images, sizes and boxes (down and up, boxes of whole pixels
    the output's size among them): bit for bit Pillow's horizontal pass then its vertical pass,
    each a resize along one axis; within 1 of Pillow's one call, which in Pillow 13.0 runs the
    vertical pass first for some shapes."""
    from hetconv.data.resample import resize_box as compiled
    rng = np.random.default_rng(7)
    for trial in range(80):
        h, w = (int(v) for v in rng.integers(5, 300, 2))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        size = int(rng.integers(1, 90))
        if trial % 8 == 0 and size <= min(h, w):
            x0, y0 = int(rng.integers(0, w - size + 1)), int(rng.integers(0, h - size + 1))
            box = (x0, y0, x0 + size, y0 + size)
        else:
            x0, y0 = rng.uniform(0, w - 1), rng.uniform(0, h - 1)
            box = (x0, y0, rng.uniform(x0 + 0.5, w), rng.uniform(y0 + 0.5, h))
        image = Image.fromarray(pixels)
        across = image.resize((size, h), Image.BILINEAR, box=(box[0], 0, box[2], h))
        want = np.asarray(across.resize((size, size), Image.BILINEAR, box=(0, box[1], size, box[3])))
        got = compiled(pixels, box, size)
        np.testing.assert_array_equal(got, want.transpose(2, 0, 1), err_msg=f"{w}x{h} {box} to {size}")
        one_call = np.asarray(image.resize((size, size), Image.BILINEAR, box=box)).transpose(2, 0, 1)
        assert np.abs(got.astype(int) - one_call).max() <= 1
    with pytest.raises(ValueError, match="not inside the 20x10 image"):
        compiled(np.zeros((10, 20, 3), np.uint8), (0, 0, 21, 10), 4)


def test_flags_bound_crop_by_the_image_size_and_photo_only_options(tmp_path):
    Config(crop=200, image_size=224, augment="random-resized-crop,flip").validate()
    with pytest.raises(ValueError, match=r"--crop 240 is larger than --image-size 224"):
        Config(crop=240, image_size=224).validate()
    with pytest.raises(ValueError, match=r"random-resized-crop applies to a photo folder: give --image-size"):
        Config(augment="random-resized-crop").validate()
    with pytest.raises(ValueError, match=r"--bad-images must be 'fail' or 'skip'"):
        Config(bad_images="ignore").validate()
    with pytest.raises(DataError, match=r"--image-size 16 applies to an image folder"):
        load_dataset("synthetic", image_size=16)
    write_photos(tmp_path / "pets", per_class=(2, 1))
    os.rename(tmp_path / "pets/val", tmp_path / "pets/elsewhere")
    with pytest.raises(DataError, match=r"no val/ or test/ directory.*--val-split"):
        load_dataset(tmp_path / "pets", image_size=16)
    held = load_dataset(tmp_path / "pets", image_size=16, val_split=0.5)
    assert len(held.test_y) == 3 and len(held.train_y) == 3 and held.test_x.shape == (3, 3, 16, 16)


# ---------------------------------------------------------------------------------------------
# The loader processes

def _no_leftovers(loader):
    assert loader.workers == [] and loader.shm is None


def test_loader_processes_give_the_batches_one_process_makes_and_end_cleanly(tmp_path):
    from hetconv.data.batches import batches
    from hetconv.data.loader import PhotoLoader, open_loader
    write_photos(tmp_path / "pets", per_class=(5, 2))
    ds = load_dataset(tmp_path / "pets", image_size=12)
    augment = ("random-resized-crop", "flip")
    lines = []
    loader = open_loader(ds, 4, augment, seed=3, workers=2, log=lines.append, prefetch=3)
    assert isinstance(loader, PhotoLoader) and "photo loader: 2 processes (--loader-workers), 3 batches" in lines[0]
    try:
        name = loader.shm.name
        for epoch, start in ((0, 0), (1, 2)):          # a resumed epoch starts at its batch
            ours = list(loader.epoch(epoch, start=start))
            theirs = list(batches(ds, 4, np.random.default_rng([3, epoch]), augment=augment, seed=3, epoch=epoch,
                                  start=start))
            assert len(ours) == len(theirs) == 3 - start
            for (x, y), (x2, y2) in zip(ours, theirs):
                np.testing.assert_array_equal(x, x2)
                np.testing.assert_array_equal(y, y2)
        abandoned = loader.epoch(2)
        next(abandoned)                                # left with batches decoding ahead
        tests = list(loader.test_batches(4))
        assert [len(y) for _, y in tests] == [4, 2]
        np.testing.assert_array_equal(tests[1][0], ds.normalize(ds.test_x[4:6]))
        processes = list(loader.workers)
    finally:
        loader.close()
    _no_leftovers(loader)
    assert not any(p.is_alive() for p in processes)
    from multiprocessing import shared_memory
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def test_a_photo_that_fails_in_a_loader_is_named_and_fails_or_is_replaced(tmp_path):
    from hetconv.data.loader import PhotoLoader
    write_photos(tmp_path / "pets", per_class=(2, 1))
    ds = load_dataset(tmp_path / "pets", image_size=12)
    broken = ds.train_x.files[4]
    with open(broken, "wb") as f:                      # broken after the listing checked it
        f.write(b"\xff\xd8\xff\xe0 gone")
    with PhotoLoader(ds, 6, (), workers=1) as loader:
        with pytest.raises(DataError, match=rf"{broken}: cannot be decoded: .*a loader could not decode it; "
                                            rf"--bad-images skip replaces"):
            list(loader.epoch(0))
        assert len(list(loader.test_batches())) == 1              # the loader goes on after the error
    _no_leftovers(loader)
    with PhotoLoader(ds, 6, (), workers=1, skip=True) as loader:
        (x, y), = list(loader.epoch(0))
        order = np.random.default_rng([0, 0]).permutation(6)
        k = int(np.flatnonzero(order == 4)[0])
        src = (k + 1) % 6
        np.testing.assert_array_equal(x[k], x[src])
        assert y[k] == y[src] and loader.skipped == [(broken, loader.skipped[0][1])]
    _no_leftovers(loader)


def test_a_dead_loader_process_ends_the_epoch_with_an_error_not_a_hang(tmp_path):
    import signal
    import time
    from hetconv.data.loader import PhotoLoader
    write_photos(tmp_path / "pets", per_class=(4, 1))
    ds = load_dataset(tmp_path / "pets", image_size=12)
    with PhotoLoader(ds, 2, (), workers=1, prefetch=2) as loader:
        batches = loader.epoch(0)
        next(batches)
        os.kill(loader.workers[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(DataError, match=r"photo loader process hetconv-loader-0 .* exited with code -9"):
            for _ in batches:
                pass
        assert time.monotonic() - started < 10
    _no_leftovers(loader)


# ---------------------------------------------------------------------------------------------
# Bad photos, found at listing

def test_bad_photos_are_named_at_listing_and_refused_or_left_out(tmp_path, monkeypatch):
    write_photos(tmp_path / "pets", per_class=(2, 1), size_range=(18, 30))
    train = tmp_path / "pets/train"
    rng = np.random.default_rng(4)
    image = Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    image.save(train / "cat/whole.jpg")
    data = (train / "cat/whole.jpg").read_bytes()
    (train / "cat/truncated.jpg").write_bytes(data[:len(data) // 2])
    (train / "cat/empty.jpg").write_bytes(b"")
    (train / "dog/corrupt.jpg").write_bytes(b"\xff\xd8\xff" + rng.bytes(200))
    image.convert("CMYK").save(train / "dog/cmyk.jpg")                 # fine: converted to RGB
    Image.fromarray(np.zeros((20, 24), np.uint16)).save(train / "dog/wide.png")
    Image.new("RGB", (60, 60)).save(train / "eel/bomb.png")
    (train / "eel/notes.txt").write_text("not a photo")
    (train / "fox").mkdir()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)                # 60 x 60 is past it; 40 x 40 is not
    with pytest.raises(DataError) as refused:
        load_dataset(tmp_path / "pets", image_size=16)
    said = str(refused.value)
    assert said.startswith(f"{tmp_path / 'pets'}: 7 bad files (--bad-images skip leaves them out): ")
    for name, why in (("cat/empty.jpg", "an empty file (0 bytes)"),
                      ("cat/truncated.jpg", "a truncated JPEG (no end-of-image marker)"),
                      ("dog/corrupt.jpg", "not a readable JPEG, PNG or WebP photo"),
                      ("dog/wide.png", "mode I;16 (16-bit); expected 8 bits a channel"),
                      ("eel/bomb.png", "a decompression bomb"),
                      ("eel/notes.txt", "not a photo by its name"),
                      ("fox", "an empty class directory")):
        assert f"{train / name}: {why}" in said, (name, said)
    assert "cmyk" not in said and "whole" not in said
    monkeypatch.setattr(photos, "BAD_SHOWN", 2)
    with pytest.raises(DataError, match=r"; and 5 more$"):
        load_dataset(tmp_path / "pets", image_size=16)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'pets/train'}: 1 of the 4 classes left with no usable training "
                                        rf"photo by --bad-images skip \(fox\): a network would have outputs for "
                                        rf"classes it never sees"):
        load_dataset(tmp_path / "pets", image_size=16, bad_images="skip")
    (train / "fox").rmdir()
    ds = load_dataset(tmp_path / "pets", image_size=16, bad_images="skip")
    assert ds.classes == CLASSES and len(ds.train_y) == 6 + 2
    assert any("--bad-images skip: left out 6 bad files" in note for note in ds.notes)
    assert ds.train_x[ds.train_x.files.index(str(train / "dog/cmyk.jpg"))].shape == (3, 16, 16)


# ---------------------------------------------------------------------------------------------
# hetconv-data

def test_hetconv_data_describes_a_photo_folder_and_times_its_loader(tmp_path, capsys):
    from hetconv.cli import data
    write_photos(tmp_path / "pets", per_class=(4, 2))
    (tmp_path / "pets/val/dog/1.png").write_bytes(b"\x89PNG\r\n\x1a\n cut")
    assert data.main([str(tmp_path / "pets")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{tmp_path / 'pets'}: a photo folder of 3 classes: cat, dog, eel"
    assert out[1:3] == ["  train/: 12 photos, 4 to 4 a class", "  val/: 5 photos, 1 to 2 a class"]
    assert out[3].startswith("  shorter side: 0-63 px 17") and out[4] == "  formats: PNG 8, JPEG 6, WEBP 3"
    assert out[5].startswith("  bad files: 1 (a run refuses the folder") and "val/dog/1.png: not a readable" in out[5]
    assert data.main([str(tmp_path / "pets"), "--bench", "--image-size", "16", "--batch-size", "4",
                      "--augment", "random-resized-crop,flip", "--loader-workers", "1", "--bad-images", "skip"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("training loader: 2 batches of 4 in ") and last.endswith(" images/s")
    assert data.main([str(tmp_path / "pets"), "--bench"]) == 2
    assert "--bench on a folder of photos needs --image-size S" in capsys.readouterr().err


def test_evaluation_of_a_photo_folder_through_loader_processes_equals_decoding_in_process(tmp_path):
    """hetconv-eval takes a photo folder's test photos from loader processes (uint8, normalised with
    the model's statistics, as in-process): the same loss, accuracy and confusion."""
    from types import SimpleNamespace
    from hetconv.data.base import normalize
    from hetconv.data.loader import PhotoLoader
    from hetconv.training.trained_model import evaluate
    write_photos(tmp_path / "pets", per_class=(4, 3))
    ds = load_dataset(tmp_path / "pets", image_size=12)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)                 # the model's, not the folder's
    model = SimpleNamespace(classes=ds.classes, normalize=lambda x: normalize(x, mean, std), crop=lambda x: x)
    w = np.random.default_rng(0).normal(size=(3 * 12 * 12, len(ds.classes))).astype(np.float32)
    runner = SimpleNamespace(logits=lambda x: x.reshape(len(x), -1) @ w)
    alone = evaluate(model, runner, ds.test_x, ds.test_y, 4)
    with PhotoLoader(ds, 4, workers=1) as loader:
        batches = list(loader.test_batches(raw=True))
        assert all(x.dtype == np.uint8 for x, _ in batches) and len(batches) > 1
        ours = evaluate(model, runner, ds.test_x, ds.test_y, 4, batches=iter(batches))
    assert ours == alone and ours["images"] == len(ds.test_y)


def test_a_splits_class_directories_are_read_with_a_bound_and_checked(tmp_path, monkeypatch):
    """One listing for the photo folder and the in-memory folder: no class directory, one that is
    not a training class, and more than the bound are each refused naming the directory."""
    from hetconv.data import base
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no class directories; expected .*/<class>/\*\.jpg"):
        base.class_directories(tmp_path / "empty", None, "*.jpg")
    for name in ("cat", "dog", ".hidden"):
        (tmp_path / "val" / name).mkdir(parents=True)
    assert base.class_directories(tmp_path / "val", None, "*.jpg") == (("cat", "dog"), ["cat", "dog"])
    with pytest.raises(DataError, match=r"val/dog: class 'dog' is not among the 2 classes of .*/train"):
        base.class_directories(tmp_path / "val", ("ant", "cat"), "*.jpg")
    monkeypatch.setattr(base, "MAX_CLASSES", 1)
    with pytest.raises(DataError, match="more than 1 class directories: not read"):
        base.class_directories(tmp_path / "val", None, "*.jpg")
    with pytest.raises(DataError, match="missing: cannot be listed"):
        base.class_directories(tmp_path / "missing", None, "*.jpg")


# ---------------------------------------------------------------------------------------------
# Links in a folder

@pytest.mark.timeout(30)
def test_links_are_followed_each_directory_once_and_the_loops_said(tmp_path, capsys):
    """A class folder holding two links to itself (a tree of 2^40 paths when each is followed)
    lists each photo once, with one line naming the links not followed; a link to a directory
    elsewhere is followed, by the photo folder and the in-memory folder alike."""
    from hetconv.cli import data
    write_photos(tmp_path / "pets", per_class=(2, 1))
    elsewhere = tmp_path / "more_cats"
    elsewhere.mkdir()
    Image.new("RGB", (30, 20)).save(elsewhere / "far.png")
    cat = tmp_path / "pets/train/cat"
    os.symlink(".", cat / "a")
    os.symlink(".", cat / "b")
    os.symlink(elsewhere, cat / "more")
    ds = load_dataset(tmp_path / "pets", image_size=12)
    files = [os.path.realpath(f) for f in ds.train_x.files]
    assert len(files) == len(set(files)) == 3 * 2 + 1
    assert str(cat / "more/far.png") in ds.train_x.files
    said = [n for n in ds.notes if "skipped" in n]
    assert said == [f"{tmp_path / 'pets'}: skipped 2 links to a directory already listed (a link loop or a second "
                    f"way in), so no photo is listed twice: {cat / 'a'}, {cat / 'b'}"]
    assert data.main([str(tmp_path / "pets")]) == 0
    out = capsys.readouterr().out
    assert "skipped 2 links to a directory already listed" in out and "train/: 7 photos" in out
    for f in ds.train_x.files + ds.test_x.files:                  # the in-memory reader: one size
        with Image.open(f) as im:
            im.convert("RGB").resize((8, 8)).save(f, format=im.format)
    held = load_dataset(tmp_path / "pets")
    assert len(held.train_y) == 7 and [n for n in held.notes if "skipped" in n] == said


def test_a_photo_that_never_ends_stops_the_loader_by_its_deadline_naming_it(tmp_path):
    """A listed photo swapped for a fifo (its read blocks for ever, as on a hung file system):
    the wait ends at the loader's deadline with one line naming that photo, and close() ends the
    stuck process."""
    import time
    from hetconv.data.loader import PhotoLoader
    write_photos(tmp_path / "pets", per_class=(2, 1))
    ds = load_dataset(tmp_path / "pets", image_size=12)
    stuck = ds.train_x.files[3]
    os.remove(stuck)
    os.mkfifo(stuck)
    with PhotoLoader(ds, 6, (), workers=1, deadline_s=1.0) as loader:
        started = time.monotonic()
        with pytest.raises(DataError) as ended:
            list(loader.epoch(0))
        waited = time.monotonic() - started
        processes = list(loader.workers)
    assert str(ended.value).startswith(f"{stuck}: loader process hetconv-loader-0 has been decoding it for more "
                                       f"than 1 s (hetconv.data.loader.PHOTO_DEADLINE_S)")
    assert "\n" not in str(ended.value) and waited < 1.0 + 20           # the process's start, then the deadline
    _no_leftovers(loader)
    assert not any(p.is_alive() for p in processes)


def test_every_loader_wait_is_bounded_when_the_processes_stop_moving(monkeypatch):
    """The checks every poll of a wait makes, on recorded progress (no process started): a photo
    decoding past the deadline is named; processes idle past it while a batch is waited for, or
    one not started within START_DEADLINE_S, end the wait too; a fresh submit resets the idle clock."""
    import time
    from types import SimpleNamespace
    from hetconv.data import loader as loader_module
    from hetconv.data.loader import PhotoLoader
    now = time.monotonic()
    waiting = object.__new__(PhotoLoader)
    waiting.workers = [SimpleNamespace(name="hetconv-loader-0", pid=1), SimpleNamespace(name="hetconv-loader-1", pid=2)]
    waiting.deadline_s, waiting._started, waiting._moved = 5.0, now - 100, now - 100
    waiting._paths = {7: ["a.jpg", "b.jpg"]}
    waiting._progress = [[7.0, 1.0, now - 6], [0.0, 0.0, now - 1]]
    with pytest.raises(DataError, match=r"^b\.jpg: loader process hetconv-loader-0 has been decoding it for more "
                                        r"than 5 s"):
        waiting._check_moving()
    waiting._progress = [[7.0, 1.0, now - 1], [0.0, 0.0, now - 50]]
    waiting._check_moving()                                  # one still within its photo's deadline
    waiting._progress = [[0.0, 0.0, now - 50], [0.0, 0.0, now - 60]]
    with pytest.raises(DataError, match=r"^photo loader: no loader process took a batch or returned one for 50 s"):
        waiting._check_moving()
    waiting._moved = now
    waiting._check_moving()
    waiting._progress = [[0.0, 0.0, 0.0], [0.0, 0.0, now]]
    monkeypatch.setattr(loader_module, "START_DEADLINE_S", 50.0)
    with pytest.raises(DataError, match=r"process hetconv-loader-0 \(pid 1\) did not start within 50 s"):
        waiting._check_moving()


# ---------------------------------------------------------------------------------------------
# Decompression bombs: the pixel budget

def _claiming(path, small, width, height):
    """Write at `path` the tiny photo `small` (a PNG or JPEG file's bytes) with its header patched
    to claim width x height: nothing that size is ever written or, checked first, decoded."""
    import struct
    import zlib
    data = bytearray(small)
    if data.startswith(b"\x89PNG"):
        data[16:24] = struct.pack(">II", width, height)                     # IHDR's width, height
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))      # its CRC: type and data
    else:
        at = data.index(b"\xff\xc0") + 5                                     # SOF0: length, precision, then
        data[at:at + 4] = struct.pack(">HH", height, width)
    path.write_bytes(bytes(data))


def _small(fmt):
    import io
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 10)).save(out, format=fmt)
    return out.getvalue()


def test_a_photo_past_the_pixel_budget_is_refused_from_its_header_naming_one_limit(tmp_path, monkeypatch):
    """A 20000x20000 PNG (400 megapixels, 1.6 GB decoded) and JPEG are refused at listing and in
    decode from their headers, memory untouched; every message names the one limit, pixel_limit:
    the decode budget over 4 bytes a pixel and the loader processes, at most Pillow's."""
    import resource
    from hetconv.data.photos import BadImage, decode, pixel_limit
    write_photos(tmp_path / "pets", per_class=(2, 1))
    huge = tmp_path / "pets/train/cat/huge.png"
    _claiming(huge, _small("PNG"), 20000, 20000)
    _claiming(tmp_path / "huge.jpg", _small("JPEG"), 20000, 20000)
    _claiming(tmp_path / "big.png", _small("PNG"), 10000, 10000)           # between Pillow's two limits
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    limit = pixel_limit(photos.loader_processes(0)[0])
    assert pixel_limit(1) == min(Image.MAX_IMAGE_PIXELS, photos.DECODE_BUDGET_BYTES // 4)
    with pytest.raises(DataError) as refused:
        load_dataset(tmp_path / "pets", image_size=12)
    assert (f"{huge}: a decompression bomb: 400,000,000 pixels, more than the {limit:,} a photo may have (the "
            f"decode budget hetconv.data.photos.DECODE_BUDGET_BYTES") in str(refused.value)
    ds = load_dataset(tmp_path / "pets", image_size=12, bad_images="skip")
    assert str(huge) not in ds.train_x.files and len(ds.train_y) == 6
    box = lambda w, h: (0, 0, w, h)                                  # noqa: E731
    for path, pixels in ((huge, "400,000,000"), (tmp_path / "huge.jpg", "400,000,000"),
                         (tmp_path / "big.png", "10000x10000 = 100,000,000")):
        for draft in (True, False):                                  # simplejpeg's header, Pillow's
            with pytest.raises(BadImage, match=rf"^a decompression bomb: (20000x20000 = )?{pixels} pixels, more than "
                                               rf"the {pixel_limit(1):,} a photo may have"):
                decode(str(path), 12, box, draft=draft)
    held = tmp_path / "held"                                          # the in-memory reader names it alike
    (held / "train/cat").mkdir(parents=True)
    (held / "test/cat").mkdir(parents=True)
    _claiming(held / "train/cat/big.png", _small("PNG"), 10000, 10000)
    (held / "test/cat/small.png").write_bytes(_small("PNG"))
    with pytest.raises(DataError, match=rf"big\.png: a decompression bomb: 10000x10000 = 100,000,000 pixels, more "
                                        rf"than the {pixel_limit(1):,} a photo may have"):
        load_dataset(held)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 300 << 20


def test_the_pixel_limit_shrinks_with_the_loader_processes_at_listing_and_in_the_loader(tmp_path, monkeypatch):
    from hetconv.data.loader import PhotoLoader
    write_photos(tmp_path / "pets", per_class=(2, 1), size_range=(18, 30))
    Image.new("RGB", (60, 60)).save(tmp_path / "pets/train/dog/wide.jpg")           # 3600 pixels
    monkeypatch.setattr(photos, "DECODE_BUDGET_BYTES", 4 * 2 * 3000)
    monkeypatch.setattr(photos, "usable_cores", lambda: 8)
    assert photos.pixel_limit(1) == 6000 and photos.pixel_limit(2) == 3000
    assert len(load_dataset(tmp_path / "pets", image_size=12, loader_workers=1).train_y) == 7
    with pytest.raises(DataError, match=r"wide\.jpg: a decompression bomb: 60x60 = 3,600 pixels, more than the "
                                        r"3,000 a photo may have"):
        load_dataset(tmp_path / "pets", image_size=12, loader_workers=2)
    ds = load_dataset(tmp_path / "pets", image_size=12, loader_workers=1)
    monkeypatch.setattr(photos, "DECODE_BUDGET_BYTES", 4 * 3000)                     # as if 2 processes
    with PhotoLoader(ds, 7, (), workers=1) as loader:
        assert loader.pixel_limit == 3000
        with pytest.raises(DataError, match=r"wide\.jpg: a decompression bomb: 60x60 = 3,600 pixels, more than the "
                                            r"3,000 a photo may have .*: a loader could not decode it"):
            list(loader.epoch(0))


def test_a_class_that_skipping_leaves_empty_is_refused_not_trained_unseen(tmp_path):
    """Every photo of a class bad: --bad-images skip refuses the folder naming the class, rather
    than keep an output class no training photo is of."""
    write_photos(tmp_path / "pets", per_class=(2, 1))
    for f in (tmp_path / "pets/train/eel").iterdir():
        f.write_bytes(b"")
    with pytest.raises(DataError, match=r"train: 1 of the 3 classes left with no usable training photo by --bad-images "
                                        r"skip \(eel\)"):
        load_dataset(tmp_path / "pets", image_size=12, bad_images="skip")


# ---------------------------------------------------------------------------------------------
# hetconv-eval on a photo folder

def test_hetconv_eval_reads_the_test_split_alone_and_takes_the_flags_it_advises(tmp_path, monkeypatch, capsys):
    """A bad file in train/ does not stop an evaluation, which reads val/ alone; the advice its
    refusals give (--bad-images skip, --image-size S) are flags it takes."""
    from types import SimpleNamespace
    from hetconv.cli import evaluate as eval_command
    write_photos(tmp_path / "pets", per_class=(2, 2))
    (tmp_path / "pets/train/cat/empty.jpg").write_bytes(b"")
    model = SimpleNamespace(path="ckpt", step=1, notes=[], classes=CLASSES, config={"data": str(tmp_path / "pets")},
                            data={"name": "pets", "image_shape": [3, 12, 12], "photos": {"image_size": 12}})
    monkeypatch.setattr(eval_command, "load_model", lambda path: model)
    seen = []
    monkeypatch.setattr(eval_command, "evaluation", lambda model, ds, args: seen.append(ds) or {"images": 0})
    assert eval_command.main(["ckpt", "--json"]) == 0, capsys.readouterr().err
    assert len(seen[-1].test_y) == 6 and len(seen[-1].train_y) == 0
    (tmp_path / "pets/val/dog/0.jpg").write_bytes(b"")
    assert eval_command.main(["ckpt", "--json"]) == 2
    assert "1 bad file (--bad-images skip leaves them out): " in capsys.readouterr().err
    assert eval_command.main(["ckpt", "--json", "--bad-images", "skip"]) == 0
    assert len(seen[-1].test_y) == 5
    del model.data["photos"]                                    # a model of one-size images held in memory
    (tmp_path / "pets/val/dog/0.jpg").unlink()
    assert eval_command.main(["ckpt", "--json"]) == 2
    err = capsys.readouterr().err
    assert "give --image-size S to resize and crop photos of any size" in err
    assert eval_command.main(["ckpt", "--json", "--image-size", "12"]) == 0
    assert len(seen[-1].test_y) == 5


# ---------------------------------------------------------------------------------------------
# --loader-workers and hetconv-data's help

def test_more_loader_workers_than_usable_cores_are_capped_saying_so(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace
    from hetconv.cli import data
    from hetconv.cli import evaluate as eval_command
    from hetconv.data import loader as loader_module
    write_photos(tmp_path / "pets", per_class=(2, 1))
    ds = load_dataset(tmp_path / "pets", image_size=12)
    monkeypatch.setattr(photos, "usable_cores", lambda: 2)

    class Started:                                     # the processes PhotoLoader would start, counted
        def __init__(self, ds, batch_size, augment=(), seed=0, workers=1, prefetch=0):
            self.workers, self.slots, self.shm = workers, 2, SimpleNamespace(size=0)

        def test_batches(self, raw=False):
            return iter(())

        def close(self):
            pass
    monkeypatch.setattr(loader_module, "PhotoLoader", Started)
    lines = []
    assert loader_module.open_loader(ds, 2, workers=100, log=lines.append).workers == 2
    assert lines[0] == ("--loader-workers 100 is more than the 2 usable cores (the process's CPU affinity): "
                        "2 loader processes")
    assert "photo loader: 2 processes (--loader-workers, capped)" in lines[1]
    assert loader_module.open_loader(ds, 2, workers=2, log=lines.append).workers == 2 and len(lines) == 3
    monkeypatch.setattr(eval_command, "PhotoLoader", Started)
    monkeypatch.setattr(eval_command, "InProcessModel", lambda model, threads=None: None)
    monkeypatch.setattr(eval_command, "evaluate", lambda *a, **k: {})
    model = SimpleNamespace(path="ckpt", step=1, config={}, data={})
    eval_command.evaluation(model, ds, eval_command.build_parser().parse_args(["ckpt", "--loader-workers", "100"]))
    assert capsys.readouterr().err.strip() == ("hetconv-eval: --loader-workers 100 is more than the 2 usable cores (the "
                                               "process's CPU affinity): 2 loader processes")
    helped = " ".join(data.build_parser().format_help().split())
    assert "--batch-size BATCH_SIZE images per step (default: 128)" in helped
