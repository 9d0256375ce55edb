"""CIFAR-10 and CIFAR-100 in their official python format: the directory or the .tar.gz archive.

The files are pickles, read with the restricted unpickler (plain containers and numpy arrays
only) and checked (shape, dtype, label range, counts); a problem raises DataError naming the file
and what was expected. CIFAR-100 keeps `fine_labels` (100 classes) unless asked for its
`coarse_labels` (20), as torchvision does.
"""

from __future__ import annotations

import os
import tarfile
import zlib
from pathlib import Path

import numpy as np

from hetconv.data.base import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, DataError, DataSet, check_bytes, check_labels
from hetconv.data.unpickle import restricted_load as _unpickle

ROW_BYTES = 3 * 32 * 32                      # one image in a CIFAR file: R, G, B planes of 32x32
IMAGE_SHAPE = (3, 32, 32)

DIR_NAME = "cifar-10-batches-py"
TAR_NAME = "cifar-10-python.tar.gz"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
# The most bytes read from any one file or archive member: a CIFAR-10 batch is about 31 MB. A gzip
# archive of 0.3 MB can hold a member of 300 MB of zeros; the cap refuses it before it is read.
MAX_MEMBER_BYTES = 64 << 20

DIR_NAME_100 = "cifar-100-python"
TAR_NAME_100 = "cifar-100-python.tar.gz"
TRAIN_FILE_100, TEST_FILE_100, META_FILE_100 = "train", "test", "meta"
# CIFAR-100 keeps all 50000 training images in one file of about 155 MB.
MAX_MEMBER_BYTES_100 = 192 << 20
# A tar archive is read as a stream: every byte before the last member wanted is decompressed, and
# tarfile holds each header it passes. The official archives hold 9 members (CIFAR-10) and 5
# (CIFAR-100) in 186 MB and 178 MB; the caps refuse an archive that runs past them when its header
# says so, before reading on.
MAX_ARCHIVE_BYTES = 512 << 20
MAX_ARCHIVE_MEMBERS = 256
# A pax or GNU long-name header is read whole into memory before tarfile returns its member; a
# real one is a few hundred bytes.
MAX_HEADER_BYTES = 1 << 20
MAX_NAME = 256                               # one class name in a meta file
LABELS_100 = {"fine": ("fine_labels", "fine_label_names", 100),
              "coarse": ("coarse_labels", "coarse_label_names", 20)}

_CIFAR10_FILES = TRAIN_FILES + (TEST_FILE, META_FILE)
_CIFAR100_FILES = (TRAIN_FILE_100, TEST_FILE_100, META_FILE_100)


def _cap(name: str) -> int:
    return MAX_MEMBER_BYTES_100 if name in _CIFAR100_FILES else MAX_MEMBER_BYTES


def _what(name: str) -> str:
    return "CIFAR-100" if name in _CIFAR100_FILES else "CIFAR-10"


def _str_keys(obj, source: str, what: str) -> dict:
    if not isinstance(obj, dict):
        raise DataError(f"{source}: expected a pickled dict ({what}), got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _parse_batch(obj, source: str, label_key: str = "labels",
                 classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """A data batch dict -> images (N, 3, 32, 32) uint8, labels (N,) int64."""
    d = _str_keys(obj, source, f"with 'data' and '{label_key}'")
    missing = [k for k in ("data", label_key) if k not in d]
    if missing:
        found = sorted(k if isinstance(k, str) else type(k).__name__ for k in d)[:20]
        raise DataError(f"{source}: missing key(s) {missing}; expected 'data' and '{label_key}', found {found}")
    data, labels = d["data"], d[label_key]
    if not isinstance(data, np.ndarray):
        raise DataError(f"{source}: 'data' must be a numpy array (N x {ROW_BYTES} uint8), "
                        f"got {type(data).__name__}")
    if data.dtype != np.uint8:
        raise DataError(f"{source}: 'data' must be uint8, got {data.dtype}")
    if data.ndim != 2 or data.shape[1] != ROW_BYTES:
        raise DataError(f"{source}: 'data' must be N x {ROW_BYTES} (R, G, B planes of 32x32), "
                        f"got shape {data.shape}")
    # The labels' type is checked before numpy converts them: np.asarray of anything else (nested
    # lists, a long bytes object among ints) may allocate far more than the file holds.
    flat = (isinstance(labels, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in labels)) or \
        (isinstance(labels, np.ndarray) and labels.ndim == 1 and (not labels.size or labels.dtype.kind in "iu"))
    if not flat:
        raise DataError(f"{source}: '{label_key}' must be a flat list of ints 0..{classes - 1}, got {_describe(labels)}")
    if len(labels) != len(data):
        raise DataError(f"{source}: {len(labels)} labels for {len(data)} images; expected one label "
                        f"per row of 'data'")
    try:
        y = np.asarray(labels, np.int64)
    except OverflowError:
        raise DataError(f"{source}: '{label_key}' holds an int too large for any class 0..{classes - 1}") from None
    y = check_labels(y, classes, source)
    # Row-major reshape: the first 1024 bytes of a row are the R plane -> channel 0, and so on.
    return data.reshape(-1, *IMAGE_SHAPE), y


def _describe(obj) -> str:
    """What a pickled value is, in a few words: never its repr, which may be as large as the file."""
    if isinstance(obj, np.ndarray):
        return f"a {obj.dtype} array of shape {obj.shape}"
    kinds = sorted({type(v).__name__ for v in obj}) if isinstance(obj, (list, tuple)) else []
    return f"a {type(obj).__name__}" + (f" of {len(obj)} ({', '.join(kinds[:4])})" if kinds else "")


def _parse_names(obj, source: str, key: str, count: int) -> tuple[str, ...]:
    d = _str_keys(obj, source, f"with '{key}'")
    names = d.get(key)
    if not isinstance(names, (list, tuple)) or len(names) != count or \
            not all(isinstance(n, (bytes, str)) and len(n) <= MAX_NAME for n in names):
        raise DataError(f"{source}: '{key}' must be a list of {count} names (each at most {MAX_NAME} characters), "
                        f"got {_describe(names)}")
    return tuple(n.decode("latin1") if isinstance(n, bytes) else n for n in names)


# ---------------------------------------------------------------------------------------------
# On disk: the directory or the archive, read once

def resolve_path(path: Path) -> Path | None:
    """A CIFAR directory, a directory holding one (or its archive), or an archive -> what to read;
    None when `path` is a directory with no CIFAR files in it."""
    if path.is_dir():
        for sub in (DIR_NAME, DIR_NAME_100):
            if (path / sub).is_dir():
                return path / sub
        if (path / TRAIN_FILES[0]).exists() or (path / TRAIN_FILE_100).is_file():
            return path
        for archive in (TAR_NAME, TAR_NAME_100):
            if (path / archive).is_file():
                return path / archive
        return None
    return path


def _load_from_dir(root: Path) -> dict:
    names = _CIFAR100_FILES if not (root / TRAIN_FILES[0]).exists() and (root / TRAIN_FILE_100).is_file() \
        else _CIFAR10_FILES
    loaded = {}
    for name in names:
        file = root / name
        if not file.is_file():
            if name in (META_FILE, META_FILE_100):
                continue
            if names is _CIFAR10_FILES:
                raise DataError(f"{file}: missing; expected the CIFAR-10 python files "
                                f"{', '.join(TRAIN_FILES)} and {TEST_FILE} in {root}")
            raise DataError(f"{file}: missing; expected the CIFAR-100 python files "
                            f"{TRAIN_FILE_100} and {TEST_FILE_100} in {root}")
        size = file.stat().st_size
        check_bytes(str(file), size, _cap(name), f"any {_what(name)} file may have")
        with open(file, "rb") as f:
            loaded[name] = _unpickle(f, str(file), _what(name), size)
    return loaded


class _ArchiveInfo(tarfile.TarInfo):
    """tarfile's member header, refusing the extended headers tarfile would read whole before
    returning (an over-long pax or long-name header) and sparse members (a map of holes that
    tarfile expands as it parses): no CIFAR archive has either."""

    def _proc_member(self, tarfile_):
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                         tarfile.GNUTYPE_LONGLINK) and self.size > MAX_HEADER_BYTES:
            raise tarfile.HeaderError(f"an extended header of {self.size} bytes, more than the "
                                      f"{MAX_HEADER_BYTES >> 20} MB one may have")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise tarfile.HeaderError("a sparse member; a CIFAR archive holds plain files")
        return super()._proc_member(tarfile_)

    def _proc_gnusparse_00(self, *args):
        raise tarfile.HeaderError("a sparse member; a CIFAR archive holds plain files")

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


def _load_from_tar(archive: Path) -> dict:
    # Members are unpickled straight from the decompressed stream, in archive order: nothing is
    # extracted to disk, and only one member's bytes are held at a time. A member's size comes
    # from its header, and extractfile never reads past it, so the cap holds for what is read.
    wanted = set(_CIFAR10_FILES + _CIFAR100_FILES)
    loaded = {}
    try:
        with tarfile.open(archive, "r:*", tarinfo=_ArchiveInfo) as tar:
            for count, member in enumerate(tar, start=1):
                where = f"{archive}:{member.name if member.name.isprintable() else ascii(member.name)}"
                if count > MAX_ARCHIVE_MEMBERS:
                    raise DataError(f"{archive}: more than {MAX_ARCHIVE_MEMBERS} members; a CIFAR archive holds "
                                    f"9 or fewer: not read further")
                if member.offset_data + member.size > MAX_ARCHIVE_BYTES:
                    raise DataError(f"{where}: ends {member.offset_data + member.size} bytes into the archive, past "
                                    f"the {MAX_ARCHIVE_BYTES >> 20} MB a CIFAR archive may hold: not read")
                name = member.name.rsplit("/", 1)[-1]
                if name not in wanted or name in loaded:
                    continue
                if not member.isfile():
                    kind = "a link" if member.issym() or member.islnk() else \
                        "a directory" if member.isdir() else "a device or fifo"
                    raise DataError(f"{where}: {kind}, not a file: CIFAR archives hold the batches themselves")
                check_bytes(where, member.size, _cap(name), f"any {_what(name)} file may have")
                stream = tar.extractfile(member)
                loaded[name] = _unpickle(stream, where, _what(name), member.size)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{archive}: not a readable {TAR_NAME} archive (truncated or a different "
                        f"file?): {type(e).__name__}: {e}") from None
    return loaded


def _read(path: str | os.PathLike) -> tuple[Path, dict]:
    given = Path(path)
    if not given.exists():
        raise DataError(f"{given}: does not exist; expected a {DIR_NAME}/ or {DIR_NAME_100}/ directory, a "
                        f"directory containing one, or the {TAR_NAME} / {TAR_NAME_100} archive")
    source = resolve_path(given)
    if source is None:
        raise DataError(f"{given}: no CIFAR files in this directory; expected {DIR_NAME}/ ({', '.join(TRAIN_FILES)}, "
                        f"{TEST_FILE}), {DIR_NAME_100}/ ({TRAIN_FILE_100}, {TEST_FILE_100}) or their archives")
    return source, (_load_from_tar(source) if source.is_file() else _load_from_dir(source))


def _where(source: Path, name: str) -> str:
    if source.is_file():
        return f"{source}:{DIR_NAME_100 if name in _CIFAR100_FILES else DIR_NAME}/{name}"
    return str(source / name)


def _cifar10(source: Path, loaded: dict) -> DataSet:
    if source.is_file():
        for name in TRAIN_FILES + (TEST_FILE,):
            if name not in loaded:
                raise DataError(f"{source}: member {DIR_NAME}/{name} missing; expected "
                                f"{', '.join(TRAIN_FILES)} and {TEST_FILE}")
    train = [_parse_batch(loaded[name], _where(source, name)) for name in TRAIN_FILES]
    test_x, test_y = _parse_batch(loaded[TEST_FILE], _where(source, TEST_FILE))
    classes = _parse_names(loaded[META_FILE], _where(source, META_FILE), "label_names", 10) \
        if META_FILE in loaded else CIFAR10_CLASSES
    # The published statistics of the CIFAR-10 training set, not recomputed: the same inputs as
    # every CIFAR-10 recipe, and a few-image test copy of the format is normalised as the real one.
    return DataSet(
        name="cifar10",
        train_x=np.concatenate([x for x, _ in train]),      # (50000, 3, 32, 32): one copy, 150 MiB
        train_y=np.concatenate([y for _, y in train]),
        test_x=np.ascontiguousarray(test_x),
        test_y=test_y,
        classes=classes,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
    )


def _cifar100(source: Path, loaded: dict, labels: str) -> DataSet:
    label_key, names_key, count = LABELS_100[labels]
    if source.is_file():
        for name in (TRAIN_FILE_100, TEST_FILE_100):
            if name not in loaded:
                raise DataError(f"{source}: member {DIR_NAME_100}/{name} missing; expected "
                                f"{TRAIN_FILE_100} and {TEST_FILE_100}")
    train_x, train_y = _parse_batch(loaded[TRAIN_FILE_100], _where(source, TRAIN_FILE_100), label_key, count)
    test_x, test_y = _parse_batch(loaded[TEST_FILE_100], _where(source, TEST_FILE_100), label_key, count)
    classes = _parse_names(loaded[META_FILE_100], _where(source, META_FILE_100), names_key, count) \
        if META_FILE_100 in loaded else tuple(str(i) for i in range(count))
    name = "cifar100" if labels == "fine" else "cifar100-coarse"
    return DataSet(name, np.ascontiguousarray(train_x), train_y, np.ascontiguousarray(test_x), test_y, classes)


def load_cifar(path: str | os.PathLike, labels: str | None = None) -> DataSet:
    """CIFAR-10 or CIFAR-100, whichever `path` holds. labels: CIFAR-100's "fine" (the default) or
    "coarse"; CIFAR-10 has one kind of label, so asking for one is refused."""
    if labels is not None and labels not in LABELS_100:
        raise DataError(f"labels={labels!r}: expected 'fine' or 'coarse' (CIFAR-100's fine_labels or coarse_labels)")
    source, loaded = _read(path)
    if TRAIN_FILES[0] in loaded or (source.is_file() and TRAIN_FILE_100 not in loaded):
        if labels is not None:
            raise DataError(f"{source}: labels={labels!r} applies to CIFAR-100 only; this is CIFAR-10")
        return _cifar10(source, loaded)
    return _cifar100(source, loaded, labels or "fine")


def load_cifar10(path: str | os.PathLike) -> DataSet:
    """CIFAR-10 from the official python format: the directory or the .tar.gz archive."""
    source, loaded = _read(path)
    if source.is_dir() and TRAIN_FILES[0] not in loaded:
        raise DataError(f"{source}: not CIFAR-10; expected {', '.join(TRAIN_FILES)} and {TEST_FILE}")
    return _cifar10(source, loaded)


def load_cifar100(path: str | os.PathLike, labels: str = "fine") -> DataSet:
    """CIFAR-100 from the official python format: the directory or the .tar.gz archive."""
    ds = load_cifar(path, labels)
    if ds.name == "cifar10":
        raise DataError(f"{path}: CIFAR-10, not CIFAR-100; expected {TRAIN_FILE_100} and {TEST_FILE_100}")
    return ds
