"""Values and files that are wrong in small ways: non-finite numbers, a data archive with an
oversized member, big-endian arrays on the wire, an unwritable metrics file, a missing CUDA extra,
a file that is not a checkpoint, flags that mean nothing together, an unreachable Ray address.
Each is refused with one line naming what was wrong (exit 2 on the command line), or said in a
note where the run is the same either way."""
import io
import pickle
import socket
import struct
import sys
import tarfile

import numpy as np
import pytest

from hetconv import flags
from hetconv.training import config
from hetconv.cli import coordinator
from hetconv.transport import protocol
from hetconv.cli import worker as worker_cli
from hetconv.worker import serve as worker
from hetconv.training.checkpoint import CheckpointError, load_newest_valid
from hetconv.data import DataError, load_cifar10
from hetconv.devices import DeviceError, open_device

CIFAR_FILE_CAP = 64 << 20          # hetconv.data.MAX_MEMBER_BYTES: a CIFAR-10 batch is about 31 MB
TINY = ["--conv", "4,8", "--fc", "8", "--batch-size", "8", "--synthetic-train", "64", "--synthetic-test", "16",
        "--steps", "1"]


def coordinator_says(capsys, *argv):
    """Run hetconv-coordinator in this process; its exit status and its one line of stderr."""
    code = coordinator.main([*TINY, *argv])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return code, err


def check_args_error(*argv):
    """The message _check_args refuses these flags with, or None when it accepts them."""
    args = coordinator.build_parser().parse_args([*TINY, *argv])
    try:
        coordinator._check_args(args, config.config_from_args(args))
    except (ValueError, ConnectionError) as e:
        return str(e)
    return None


# ---- 1. non-finite floats, negative seeds ---------------------------------------------------------

@pytest.mark.parametrize("flag,value", [
    ("--worker-timeout", "nan"), ("--op-timeout", "inf"), ("--connect-timeout", "nan"),
    ("--lr", "inf"), ("--momentum", "nan"), ("--weight-decay", "nan"), ("--weight-decay", "inf"),
])
def test_coordinator_refuses_non_finite_numbers_naming_the_flag(capsys, flag, value):
    code, err = coordinator_says(capsys, "--local", flag, value)
    assert code == 2
    assert f"{flag} must be a finite number, got {value}" in err
    assert err.count("--") == 1                  # --weight-decay nan is not blamed on --lr


def test_a_negative_seed_names_seed(capsys):
    code, err = coordinator_says(capsys, "--local", "--seed", "-1")
    assert code == 2 and "--seed must be >= 0, got -1" in err


@pytest.mark.parametrize("flag,value", [
    ("--heartbeat", "nan"), ("--connect-timeout", "nan"), ("--idle-timeout", "inf"), ("--message-limit-mb", "nan"),
])
def test_worker_refuses_non_finite_numbers_before_it_connects(flag, value):
    args = worker_cli.build_parser().parse_args(["--device", "cpu", "--connect", "tcp://127.0.0.1:5555", flag, value])
    with pytest.raises(worker.WorkerExit, match=f"^{flag} must be a finite number, got {value}$"):
        worker._check_args(args)


def test_check_range_refuses_nan_and_infinity():
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="--x must be a finite number"):
            flags.check_range("--x", value, 0)
    assert flags.check_range("--x", 2.5, 0, inclusive=False) == 2.5


# ---- 2. a CIFAR archive member bigger than any CIFAR file ---------------------------------------

class _ZeroPadded(io.RawIOBase):
    """`prefix`, then zeros up to `size` bytes, made as they are read: the archive is written
    without holding them."""

    def __init__(self, prefix, size):
        self.prefix, self.zeros = prefix, size - len(prefix)

    def readable(self):
        return True

    def readinto(self, buffer):
        if self.prefix:
            n = min(len(buffer), len(self.prefix))
            buffer[:n], self.prefix = self.prefix[:n], self.prefix[n:]
            return n
        n = min(len(buffer), self.zeros)
        buffer[:n] = bytes(n)
        self.zeros -= n
        return n


def test_an_oversized_archive_member_is_refused_unread(tmp_path, monkeypatch):
    # a pickle that declares one bytes object of the member's whole size: an unpickler would
    # hold all of it before any check could look at what it is
    size = CIFAR_FILE_CAP + (1 << 20)
    head = b"\x80\x02T" + struct.pack("<i", size - 7)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        info.size = size
        tar.addfile(info, io.BufferedReader(_ZeroPadded(head, size)))
    assert archive.stat().st_size < size // 100          # highly compressible: a small download
    read = []
    monkeypatch.setattr("hetconv.data.cifar._unpickle", lambda stream, source: read.append(source))
    with pytest.raises(DataError, match=r"cifar-10-batches-py/data_batch_1: \d+ bytes, more than the 64 MB"):
        load_cifar10(archive)
    assert read == []                                    # refused from its header, never unpickled


def test_an_oversized_file_in_a_cifar_directory_is_refused_unread(tmp_path, monkeypatch):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    with open(root / "data_batch_1", "wb") as f:
        f.truncate(CIFAR_FILE_CAP + 1)                  # sparse: no disk space used
    monkeypatch.setattr("hetconv.data.cifar._unpickle", lambda stream, source: pytest.fail(f"read {source}"))
    with pytest.raises(DataError, match=r"data_batch_1: \d+ bytes, more than the 64 MB"):
        load_cifar10(root)


# ---- 3. big-endian arrays on the wire -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i8", ">u2", "<f4", "=f4"])
def test_arrays_of_either_byte_order_arrive_with_their_values(dtype):
    values = np.array([[1.5, -2.0, 3e4], [0.25, 7.0, -1.0]]).astype(np.dtype(dtype).newbyteorder("=").name)
    sent = values.astype(dtype)
    frames = [bytes(f) for f in protocol.pack("FORWARD", 1, [sent, sent.T])]
    got = protocol.unpack(frames).arrays
    np.testing.assert_array_equal(got[0], values)
    np.testing.assert_array_equal(got[1], values.T)
    assert got[0].dtype.name == values.dtype.name


# ---- 4. a metrics file that cannot be written ---------------------------------------------------

needs_dev_full = pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full here")


@needs_dev_full
def test_a_metrics_file_that_refuses_writes_is_one_line_at_start_up(capsys):
    code, err = coordinator_says(capsys, "--local", "--metrics", "/dev/full")
    assert code == 2
    assert err == "hetconv-coordinator: --metrics '/dev/full' cannot be written: No space left on device"


@needs_dev_full
def test_metrics_writer_names_the_flag_when_a_write_fails():
    from hetconv.training.metrics import MetricsWriter
    metrics = MetricsWriter("/dev/full")
    with pytest.raises(ValueError, match=r"^--metrics '/dev/full' cannot be written: No space left on device$"):
        metrics.write("step", step=1)
    metrics.close()                              # the failed record is not written again


def test_metrics_writer_names_the_flag_when_the_file_cannot_be_opened(tmp_path):
    from hetconv.training.metrics import MetricsWriter
    with pytest.raises(ValueError, match="--metrics .* cannot be written"):
        MetricsWriter(str(tmp_path))             # a directory


# ---- 5. --device cuda:N without the CUDA extra ---------------------------------------------------

def test_a_missing_cuda_submodule_says_how_to_install(monkeypatch):
    import hetconv.devices.cuda  # noqa: F401    the real module first, so numba.cuda is whole
    monkeypatch.delitem(sys.modules, "hetconv.devices.cuda")
    monkeypatch.setitem(sys.modules, "numba.cuda.core", None)   # numba's own numba.cuda, no numba-cuda
    with pytest.raises(DeviceError, match=r"cuda:0 needs hetconv's CUDA extra.*pip install 'hetconv\[cuda\]'"):
        open_device("cuda:0")


def test_a_missing_cuda_package_is_named_before_any_worker_starts(monkeypatch, capsys):
    monkeypatch.setattr("hetconv.devices.CUDA_PACKAGE", "numba_cuda_not_installed")
    with pytest.raises(DeviceError, match=r"cuda:1 needs hetconv's CUDA extra, which is not installed"):
        open_device("cuda:1")
    code, err = coordinator_says(capsys, "--spawn", "cpu,cuda:0")
    assert code == 2 and "--spawn cuda:0 needs hetconv's CUDA extra" in err and "-e '.[cuda]'" in err


# ---- 6. --resume on a file that is not a checkpoint ---------------------------------------------

@pytest.mark.parametrize("write", [
    lambda p: p.write_bytes(pickle.dumps({"weights": [1, 2]})),
    lambda p: np.save(p, np.array([{}], dtype=object), allow_pickle=True),
    lambda p: np.savez(p, meta=np.array([{}], dtype=object)),
    lambda p: np.savez(p, weights=np.ones(3)),
    lambda p: p.write_bytes(b""),
], ids=["pickle", "npy-object", "npz-object-meta", "npz-without-meta", "empty"])
def test_a_file_that_is_not_a_checkpoint_is_named_so(tmp_path, write):
    path = tmp_path / "model.bin"
    write(path)
    path = next(tmp_path.iterdir())              # np.save adds its own suffix
    with pytest.raises(CheckpointError) as caught:
        load_newest_valid(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: not a readable hetconv checkpoint")
    assert "pickle" not in message.replace(str(path), "").lower()        # no advice to load it unsafely


def test_resume_from_a_pickle_says_it_is_not_a_checkpoint(tmp_path, capsys):
    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps({"weights": [1, 2]}))
    code, err = coordinator_says(capsys, "--local", "--resume", str(path))
    assert code == 2 and f"{path}: not a readable hetconv checkpoint" in err      # before any work
    assert "pickle" not in err.replace(str(path), "")


# ---- 7. flags that mean nothing together ---------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--spawn", "cpu,cpu", "--min-workers", "3"],
     "--min-workers 3 is more than the 2 worker(s) this run starts with (--spawn cpu,cpu)"),
    (["--spawn", "cpu:1x2", "--min-workers", "3"], "(--spawn cpu:1x2)"),
    (["--workers", "2", "--min-workers", "3"], "more than the 2 worker(s) this run starts with (--workers 2)"),
    (["--local", "--min-workers", "2"], "--min-workers 2 is for runs with workers"),
    (["--local", "--checkpoint-every", "5"], "--checkpoint-every 5 needs --checkpoint-dir"),
    (["--local", "--bind", "tcp://127.0.0.1:5555"], "--bind 'tcp://127.0.0.1:5555' is where workers connect"),
    (["--local", "--no-pin"], "--no-pin is for the CPU workers --spawn starts on this host; --local pins nothing"),
    (["--workers", "2", "--no-pin"], "--workers pins nothing"),
])
def test_flags_that_would_be_ignored_are_refused(argv, message):
    error = check_args_error(*argv)
    assert error is not None and message in error, error


def test_flags_that_work_together_are_accepted(tmp_path):
    assert check_args_error("--spawn", "cpu,cpu", "--min-workers", "2") is None
    assert check_args_error("--local", "--checkpoint-every", "5", "--checkpoint-dir", str(tmp_path / "a")) is None
    (tmp_path / "b").mkdir()
    assert check_args_error("--local", "--checkpoint-every", "5", "--resume", str(tmp_path / "b")) is None


def test_synthetic_sizes_with_a_data_set_from_files_are_refused(tmp_path, capsys):
    from cifar_fixture import write_cifar10
    data = write_cifar10(tmp_path, n_per_batch=10)
    code, err = coordinator_says(capsys, "--local", "--data", str(data))     # TINY sets both sizes
    assert code == 2 and "--synthetic-train 64 sizes the built-in data set" in err


def test_more_spawned_threads_than_cores_is_said(monkeypatch):
    monkeypatch.setattr(coordinator, "usable_cores", lambda: 4)
    note = coordinator._spawn_threads_note(["cpu:999", "cpu:2", "cpu", "cuda:0", "cpu:999"])
    assert note == ("note: --spawn cpu:999 asks for more threads than the 4 core(s) this process may use: "
                    "each such worker runs 4 thread(s)")
    assert coordinator._spawn_threads_note(["cpu:4", "cpu"]) == ""


# ---- 8. an unreachable Ray address ---------------------------------------------------------------

def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]                # nothing listens there once it is closed


@pytest.mark.timeout(60)                         # a hang guard: ray.init alone retries for minutes
@pytest.mark.parametrize("address,reason", [
    ("junk:1", "cannot resolve host 'junk'"),
    ("127.0.0.1:{port}", "nothing accepts connections on port {port} of 127.0.0.1"),
    ("junk", "expected HOST:PORT of the Ray head"),
])
def test_an_unreachable_ray_address_is_one_line(capsys, address, reason):
    pytest.importorskip("ray")
    port = closed_port()
    address, reason = address.format(port=port), reason.format(port=port)
    code, err = coordinator_says(capsys, "--launcher", "ray", "--ray-address", address, "--connect-timeout", "10")
    assert code == 2
    assert err.startswith(f"hetconv-coordinator: --ray-address {address!r}: {reason}")


@pytest.mark.timeout(60)
def test_the_ray_launcher_checks_its_address_before_ray_init(monkeypatch):
    ray = pytest.importorskip("ray")
    from hetconv.coordinator.ray import RayLauncher
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    port = closed_port()
    with pytest.raises(ConnectionError, match=f"--ray-address '127.0.0.1:{port}': nothing accepts"):
        RayLauncher(f"127.0.0.1:{port}", start_timeout=10)


def test_a_gpu_worker_refuses_threads_it_would_ignore():
    args = worker_cli.build_parser().parse_args(["--device", "cuda:0", "--connect", "tcp://127.0.0.1:5555",
                                                 "--threads", "4"])
    with pytest.raises(worker.WorkerExit, match="^--threads 4 is for a cpu device; --device cuda:0 runs on its GPU$"):
        worker._check_args(args)
