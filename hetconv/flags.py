"""Command-line helpers every entry point shares: the help layout, and the checks that turn a bad
flag value into one line naming the flag and what was expected."""
import argparse
import contextlib
import logging
import math
import os
import re
import sys
import threading
import time

from hetconv import __version__


def parse_int_list(flag, text, allow_empty):
    text = str(text).strip()
    if not text:
        if allow_empty:
            return []
        raise ValueError(f"{flag} needs at least one positive integer, e.g. {flag} 500,1500")
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} must be comma-separated positive integers, got {text!r}")
    return values


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once, after its help; text written in lines (the epilog's examples)
    keeps them. An empty or off default (no file, a switch) is not printed: '(default: )' says
    nothing."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "" \
                or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def check_finite(flag, value):
    """Raise ValueError naming the flag when a float is nan or infinite: every comparison with nan
    is false, so a range check alone lets it through to a timeout or an update that never ends."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value}")
    return value


def check_range(flag, value, low, inclusive=True):
    """Raise ValueError naming the flag unless value is finite and >= low (> low when not inclusive)."""
    check_finite(flag, value)
    if value < low or (not inclusive and value == low):
        raise ValueError(f"{flag} must be {'>=' if inclusive else '>'} {low}, got {value}")
    return value


_ENDPOINT_RE = re.compile(r"^(tcp|ipc)://(.+)$")


def check_endpoint(flag, text, bind=False):
    """A ZeroMQ endpoint: tcp://HOST:PORT or ipc://PATH (a bind may use port 0 or * for any free
    port). Raises ValueError naming what is missing, before zmq raises ZMQError about it."""
    m = _ENDPOINT_RE.match(str(text).strip())
    example = "tcp://127.0.0.1:5555"
    if not m:
        raise ValueError(f"{flag} {text!r}: expected tcp://HOST:PORT or ipc://PATH, e.g. {example}")
    if m.group(1) == "ipc":
        return text
    host, sep, port = m.group(2).rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"{flag} {text!r} has no port: expected tcp://HOST:PORT, e.g. {example}")
    if not (bind and port in ("0", "*")) and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{flag} {text!r}: the port must be a number from 1 to 65535, got {port!r}")
    return text


def usable_cores():
    """How many cores this process may run on (its affinity, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def threads_note(threads):
    """A line when --threads asks for more than this process's cores: a CPU device caps it there."""
    cores = usable_cores()
    if threads > cores:
        return (f"note: --threads {threads} is more than the {cores} core(s) this process may use: "
                f"a CPU device runs {cores} thread(s)")
    return ""


def check_output_file(flag, path):
    """Make sure `path` can be written (its folder is created), before any work is done."""
    if not path:
        return
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.isdir(path):
            raise IsADirectoryError("it is a directory")
        # append: an existing file is left as it is. The empty write reaches the device, so a
        # path that refuses every write (/dev/full) is named here, not at the first record.
        with open(path, "ab", buffering=0) as f:
            f.write(b"")
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def check_output_dir(flag, path):
    """Make sure `path` is (or can be made) a writable directory, before any work is done."""
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} is not writable")


class _PrintHandler(logging.Handler):
    """A log record as one printed line, to whatever sys.stdout (or sys.stderr) is when it comes."""

    def __init__(self, to_stderr):
        super().__init__()
        self.to_stderr = to_stderr

    def emit(self, record):
        print(self.format(record), file=sys.stderr if self.to_stderr else sys.stdout, flush=True)


def say_in_handler(text):
    """Write `text` to stderr from a signal handler: straight to file descriptor 2, past
    sys.stderr's buffer, whose lock the interrupted main thread may hold (a progress bar was
    writing): print() there raises "reentrant call" and the run would die without its save."""
    data = text.encode(errors="replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


def show_progress(logger="hetconv.devices", to_stderr=False):
    """Print the progress lines (INFO) that `logger` and those below it log during long work, such
    as a CPU device timing its conv paths (on stderr where stdout carries a result, such as JSON);
    one handler per process however often it is called. Returns it (for removeHandler)."""
    log = logging.getLogger(logger)
    log.setLevel(logging.INFO)
    for h in [h for h in log.handlers if isinstance(h, _PrintHandler)]:
        log.removeHandler(h)
    handler = _PrintHandler(to_stderr)
    log.addHandler(handler)
    return handler


@contextlib.contextmanager
def still_working(what, every_s=15.0, out=None):
    """While the block runs, a line every `every_s` seconds saying `what` is still going and for
    how long, so a long silent wait (calibrating a device) is never mistaken for a hang."""
    stop = threading.Event()
    start = time.monotonic()

    def tick():
        while not stop.wait(every_s):
            print(f"  ... still {what} ({time.monotonic() - start:.0f} s)", file=out or sys.stderr, flush=True)
    ticker = threading.Thread(target=tick, name="still-working", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


def add_version(parser):
    """--version on a command: its name and the package's version, then exit."""
    parser.add_argument("--version", action="version", version=f"{parser.prog} {__version__}",
                        help="print the version and exit")
    return parser


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (the usage is one --help away)."""

    def error(self, message):
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
