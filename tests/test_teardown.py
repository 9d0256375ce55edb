"""A process ends without touching what another thread or library still uses: oneDNN's objects go
before their engine (and not at all once the interpreter exits), the stop handlers write past
Python's stderr buffer and leave a caller's SIGALRM alone unless a stop arms the grace, the
loopback measurement receives on its own thread, a worker whose compute thread is still in a
kernel ends by os._exit."""
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hetconv.devices import dnnl_conv
from hetconv.engine import measure
from hetconv.engine.measure import measure_loopback
from hetconv.flags import say_in_handler
from hetconv.training.loop import StopNow, _StopRequests


class _RecordingApi:
    def __init__(self):
        self.destroyed = []

    def __getattr__(self, name):
        return lambda value: self.destroyed.append((name, value.value))


def test_the_engine_is_destroyed_after_whatever_was_made_on_it():
    api = _RecordingApi()

    class Library:                      # the attribute order of dnnl_conv._Library: engine, then stream
        pass

    lib = Library()
    lib.engine = dnnl_conv._Handle(api, "engine_destroy")
    lib.engine.value.value = 1
    lib.stream = dnnl_conv._Handle(api, "stream_destroy", needs=lib.engine)
    lib.stream.value.value = 2
    memory = dnnl_conv._Handle(api, "memory_destroy", needs=lib.engine)
    memory.value.value = 3
    del lib                             # its dict frees the engine's entry first
    assert api.destroyed == [("stream_destroy", 2)]
    del memory
    assert api.destroyed == [("stream_destroy", 2), ("memory_destroy", 3), ("engine_destroy", 1)]


def test_nothing_of_onednn_is_destroyed_once_the_interpreter_exits(monkeypatch):
    api = _RecordingApi()
    handle = dnnl_conv._Handle(api, "engine_destroy")
    handle.value.value = 1
    monkeypatch.setattr(dnnl_conv, "_exiting", [True])
    del handle
    assert api.destroyed == []


class _StderrMidWrite:
    """sys.stderr as a signal handler finds it while the main thread is inside its write: print()
    there raises what a BufferedWriter raises on reentry."""

    def write(self, text):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    def flush(self):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")


def test_a_handlers_line_goes_out_while_the_main_thread_holds_stderr(capfd, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _StderrMidWrite())
    say_in_handler("SIGTERM: finishing this step\n")          # past sys.stderr, to file descriptor 2
    assert "SIGTERM: finishing this step" in capfd.readouterr().err


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_callers_alarm_is_left_alone_and_given_back_after_a_stop():
    fired = []

    def callers(*_):
        fired.append(True)

    previous = signal.signal(signal.SIGALRM, callers)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with _StopRequests(saving=False, grace=5.0, bounded=True):
            assert signal.getsignal(signal.SIGALRM) is callers           # ours is not installed yet
            assert 29.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
        assert 29.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0   # a run with no stop: untouched
        with _StopRequests(saving=False, grace=5.0, bounded=True) as stop:
            stop._handle(signal.SIGTERM, None)                           # a stop arms the grace
            assert stop.requested and signal.getitimer(signal.ITIMER_REAL)[0] <= 5.0
            with pytest.raises(StopNow):
                signal.getsignal(signal.SIGALRM)(signal.SIGALRM, None)
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 28.0 < left <= 30.0, left                                 # the caller's, less the time since
        assert signal.getsignal(signal.SIGALRM) is callers and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_the_loopback_measurement_starts_no_thread(monkeypatch):
    # a receiving thread of its own was left blocked in recv when the measurement gave up and
    # destroyed the context under it
    class NoThreads:
        def Thread(*args, **kwargs):
            raise AssertionError("measure_loopback started a thread")

        def Event(*args, **kwargs):
            raise AssertionError("measure_loopback waits on another thread")

    monkeypatch.setattr(measure, "threading", NoThreads, raising=False)
    assert measure_loopback(megabytes=1, repeats=1) > 0


def test_a_worker_whose_compute_thread_is_still_in_a_kernel_ends_by_os_exit():
    # serve.exit_process with a compute thread that cannot finish: the process ends at once with
    # the code, its output flushed, no interpreter teardown (an atexit handler would print)
    code = textwrap.dedent("""
        import atexit, threading, time
        from hetconv.worker import serve
        atexit.register(lambda: print("teardown ran", flush=True))
        busy = threading.Thread(target=lambda: time.sleep(60), daemon=True)
        busy.start()
        serve._compute_still_running.append(busy)
        print("served", end="")
        serve.exit_process(143)
    """)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and done.stdout == "served", done.stdout + done.stderr
    assert time.monotonic() - t0 < 30
