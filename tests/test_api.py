"""The Python API: each call is its command (the same parser, checks, messages, run and results),
the README's example runs as printed, examples/ use nothing else, and a run started from Python
leaves no process behind however it ends."""
import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hetconv
from hetconv import api
from hetconv.cli import coordinator
from hetconv.cli import evaluate as eval_command
from hetconv.cli import export as export_command
from hetconv.training.trained_model import InProcessModel, load_test_data, log_softmax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# small and quick: one-thread workers, a short calibration, no timing of conv paths
SMALL = dict(synthetic_train=64, synthetic_test=16, threads=1, calibration_batch=4, cpu_conv_path="im2col")
SMALL_FLAGS = ["--synthetic-train", "64", "--synthetic-test", "16", "--threads", "1", "--calibration-batch", "4",
               "--cpu-conv-path", "im2col"]
TINY = dict(conv=[4, 8], fc=[8], batch_size=16, **SMALL)


def readme_example():
    """The README's Python example, as printed."""
    text = open(os.path.join(REPO, "README.md")).read()
    section = text[text.index("## From Python"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def children():
    """Processes whose parent is this one (a reaped worker is none)."""
    me, found = os.getpid(), set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                found.add(int(name))
    return found


def worker_pids(printed):
    """The pids of the workers a run announced ("worker w0-cpu (cpu on HOST, pid N): ...")."""
    return [int(p) for p in re.findall(r"^worker w\d+-\S+ \(.* pid (\d+)\)", printed, re.M)]


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's example run in a fresh directory, with hetconv.train given SMALL's sizes too;
    -> (its namespace, the keywords train got, what it printed, the directory)."""
    where = tmp_path_factory.mktemp("readme")
    given, real_train = {}, api.train

    def small_train(**flags):
        given.update(flags, **SMALL)
        return real_train(**flags, **SMALL)

    namespace, before, cwd = {}, children(), os.getcwd()
    api.train = small_train              # what hetconv.train(...) calls
    os.chdir(where)
    out_path = where / "printed.txt"
    try:
        with open(out_path, "w") as out, contextlib.redirect_stdout(out):
            exec(compile(readme_example(), "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
        api.train = real_train
    assert children() <= before, "a worker outlived the README's run"
    return namespace, given, out_path.read_text(), where


def test_the_readme_example_runs_as_printed(readme_run):
    namespace, given, printed, where = readme_run
    assert given["workers"] == ["cpu", "cpu"] and given["data"] == "synthetic"
    run, model = namespace["run"], namespace["model"]
    assert run.step == 3 * 64 // 32 and 0 <= run.test_accuracy <= 1
    assert run.history[0]["event"] == "config" and run.history[-1] == {"event": "done", **{
        k: v for k, v in run.summary.items() if k != "losses"}}
    assert [r["loss"] for r in run.history if r["event"] == "step"] == run.losses
    assert namespace["logits"].shape == (8, 10) and namespace["logits"].dtype == np.float32
    assert model.path == run.checkpoint and os.path.isfile(where / run.checkpoint)
    assert os.path.isfile(where / "model.npz")
    assert len(worker_pids(printed)) == 2 and all(gone(pid) for pid in worker_pids(printed))


def test_train_with_two_workers_gives_the_commands_losses(readme_run, tmp_path):
    """The same flags on the command line (in this process) train the same steps."""
    _, given, _, _ = readme_run
    argv = ["--net", "lenet5", "--data", "synthetic", "--spawn", "cpu,cpu", "--epochs", "3", "--batch-size", "32",
            "--lr", "0.02", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl"),
            *SMALL_FLAGS]
    assert {k for k in given if k not in SMALL} == {"net", "data", "workers", "epochs", "batch_size", "lr",
                                                     "checkpoint_dir"}
    before = children()
    assert coordinator.main(argv) == 0
    assert children() <= before
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    losses = [r["loss"] for r in records if r["event"] == "step"]
    np.testing.assert_allclose(losses, readme_run[0]["run"].losses, rtol=1e-5)


@pytest.mark.parametrize("keywords,argv", [
    (dict(foo=1), ["--foo=1"]),
    (dict(epochs="x"), ["--epochs", "x"]),
    (dict(lr=False), ["--lr", "False"]),
    (dict(split="fastest"), ["--split", "fastest"]),
    (dict(local=True, workers=["cpu"]), ["--local", "--spawn", "cpu"]),
    (dict(lr=-1), ["--lr", "-1"]),
    (dict(workers=["cpu", ""]), ["--spawn", "cpu,"]),
    (dict(local=True, checkpoint_every=5), ["--local", "--checkpoint-every", "5"]),
    (dict(data="/nonexistent/mnist"), ["--data", "/nonexistent/mnist"]),
])
def test_a_bad_keyword_gets_the_bad_flags_line(keywords, argv, capsys):
    with pytest.raises(ValueError) as refused:
        hetconv.train(**keywords)
    message = str(refused.value)
    try:
        code = coordinator.main(argv)
    except SystemExit as e:          # argparse's own errors end the command
        code = e.code
    assert code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line in (f"hetconv-coordinator: {message}", f"hetconv-coordinator: error: {message}"), (line, message)


def test_a_switch_takes_a_bool_and_help_stays_on_the_command_line():
    with pytest.raises(ValueError, match="--local is a switch: give local=True or False, got 'yes'"):
        hetconv.train(local="yes")
    with pytest.raises(ValueError, match="--help is for the command line"):
        hetconv.train(help=True)
    with pytest.raises(ValueError, match="workers= and spawn= both give the --spawn list"):
        hetconv.train(workers=["cpu"], spawn="cpu")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the loss on its way to nan
def test_a_failed_run_leaves_no_worker_behind(capsys):
    before = children()
    with pytest.raises(FloatingPointError, match="loss became nan at step 2"):
        hetconv.train(workers=["cpu", "cpu"], lr=1e30, steps=4, **TINY)
    pids = worker_pids(capsys.readouterr().out)
    assert len(pids) == 2 and all(gone(pid) for pid in pids)
    assert children() <= before


def test_ctrl_c_finishes_the_step_checkpoints_and_raises_interrupted(tmp_path):
    metrics = tmp_path / "m.jsonl"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    def ctrl_c_after_a_step():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if metrics.exists() and '"event": "step"' in metrics.read_text():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)
    threading.Thread(target=ctrl_c_after_a_step, daemon=True).start()
    with pytest.raises(hetconv.Interrupted) as stopped:
        hetconv.train(local=True, steps=100000, metrics=str(metrics), checkpoint_dir=str(tmp_path / "ck"), **TINY)
    run = stopped.value.run
    assert isinstance(stopped.value, KeyboardInterrupt) and run.interrupted
    assert 1 <= run.step < 100000 and os.path.isfile(run.checkpoint)
    assert f"SIGINT stopped the run at step {run.step}; checkpoint {run.checkpoint}" == str(stopped.value)
    assert run.history[-1]["event"] == "interrupted" and run.model.step == run.step
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_a_run_from_another_thread_trains_without_signals(tmp_path):
    done = {}
    thread = threading.Thread(target=lambda: done.update(run=hetconv.train(local=True, steps=2, **TINY)))
    thread.start()
    thread.join(timeout=120)
    assert done["run"].step == 2 and done["run"].test_accuracy is not None
    with pytest.raises(ValueError, match="this run wrote no checkpoint"):
        done["run"].model


def test_evaluate_is_hetconv_eval_json(readme_run, capsys):
    directory = readme_run[3] / "runs" / "a"
    model = hetconv.load(directory)
    for tta in ("none", "flip"):
        assert eval_command.main([str(directory), "--threads", "1", "--json", "--tta", tta]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["tta"] == tta
        assert printed == model.evaluate(threads=1, tta=tta)
    assert eval_command.main([str(directory), "--threads", "1", "--tta", "flip"]) == 0
    assert "test images, test-time augmentation flip\n" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--batch-size must be >= 1, got 0"):
        model.evaluate(batch_size=0)
    with pytest.raises(ValueError, match="argument --tta: invalid choice: 'mirror'"):
        model.evaluate(tta="mirror")


def test_tta_flip_averages_the_logits_of_each_image_and_its_mirror(readme_run):
    model = hetconv.load(readme_run[3] / "runs" / "a")
    ds = load_test_data(model)
    runner = InProcessModel(model, threads=1)
    x = model.crop(model.normalize(ds.test_x))
    plain, mirrored = runner.logits(x), runner.logits(np.ascontiguousarray(x[:, :, :, ::-1]))
    assert not np.allclose(plain, mirrored)
    by_hand = (plain + mirrored) / 2
    result = model.evaluate(threads=1, tta="flip", batch_size=len(ds.test_y))
    assert result["correct"] == int((by_hand.argmax(axis=1) == ds.test_y).sum())
    loss = -log_softmax(by_hand)[np.arange(len(ds.test_y)), ds.test_y].mean()
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(model.predict(ds.test_x / 255, threads=1, tta="flip"), by_hand, rtol=1e-4, atol=1e-5)


def test_predict_takes_pixels_in_0_1_and_refuses_anything_else(readme_run):
    model = hetconv.load(readme_run[3] / "runs" / "a")
    ds = load_test_data(model)
    expected = InProcessModel(model, threads=1).logits(model.crop(model.normalize(ds.test_x)))
    logits = model.predict(ds.test_x.astype(np.float32) / 255, batch_size=5, threads=1)
    assert logits.dtype == np.float32 and logits.shape == (len(ds.test_y), 10)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
    assert model.predict(np.zeros((0, 3, 32, 32), np.float32)).shape == (0, 10)
    for images, message in [(ds.test_x, re.escape("expected float pixels in [0, 1], got dtype uint8 (8-bit pixels: "
                                                  "divide by 255)")),
                            (ds.test_x[0] / 255, r"expected shape \(N, 3, 32, 32\), got \(3, 32, 32\) \(one image"),
                            (ds.test_x * 1.0, r"pixel values must be in \[0, 1\], got 0 to 255 \(0..255 pixels"),
                            (np.full((1, 3, 32, 32), np.nan), "pixel values must be in"),
                            (np.zeros((1, 1, 32, 32)), r"expected shape \(N, 3, 32, 32\)")]:
        with pytest.raises(ValueError, match=message):
            model.predict(images)


def test_export_is_hetconv_export(readme_run, tmp_path):
    directory = readme_run[3] / "runs" / "a"
    model = hetconv.load(directory)
    assert model.export(tmp_path / "api.npz", format="npz") == str(tmp_path / "api.npz")
    assert export_command.main([str(directory), "--format", "npz", "--out", str(tmp_path / "cli.npz")]) == 0
    ours, theirs = np.load(tmp_path / "api.npz"), np.load(tmp_path / "cli.npz")
    assert sorted(ours.files) == sorted(theirs.files) and "0.weight" in ours.files
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours.files)
    with pytest.raises(ValueError, match="argument --format: invalid choice: 'keras'"):
        model.export(tmp_path / "m.keras", format="keras")
    with pytest.raises(ValueError, match="is a directory; expected a file path"):
        model.export(tmp_path, format="npz")


def test_load_and_load_dataset_name_what_they_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        hetconv.load(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        hetconv.load_dataset(tmp_path / "nothing")
    ds = hetconv.load_dataset("synthetic", n_train=8, n_test=4)
    assert ds.train_x.shape == (8, 3, 32, 32) and ds.test_x.dtype == np.uint8 and len(ds.classes) == 10


def test_examples_use_the_python_api_only():
    scripts = [os.path.join(folder, name) for folder, _, names in os.walk(os.path.join(REPO, "examples"))
               for name in names if name.endswith(".py")]
    assert scripts
    for path in scripts:
        tree = ast.parse(open(path).read(), path)
        names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
        names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert "hetconv" in names, path
        assert not [n for n in names if n and n.startswith("hetconv.")], f"{path} imports an internal module"


def test_the_package_root_loads_the_api_on_first_use():
    """A worker imports hetconv modules: the API (and with it the commands) stays unloaded there."""
    code = ("import sys, hetconv, hetconv.flags, hetconv.data; "
            "assert 'hetconv.api' not in sys.modules and 'hetconv.cli.coordinator' not in sys.modules; "
            "assert hetconv.train.__module__ == hetconv.load.__module__ == 'hetconv.api'; "
            "import hetconv.training.loop; assert hetconv.train.__module__ == 'hetconv.api'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})


def test_train_takes_a_pytorch_module_its_weights_the_start(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
    source = ("import torch\nfrom torch import nn\n\ndef build():\n    torch.manual_seed(3)\n"
              "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), "
              "nn.Linear(4, 10))\n")
    (tmp_path / "mynet.py").write_text(source)
    flags = dict(local=True, steps=2, batch_size=16, **SMALL)
    from_file = hetconv.train(net=f"{tmp_path / 'mynet.py'}:build", **flags)
    namespace = {}
    exec(source, namespace)
    module = namespace["build"]()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    run = hetconv.train(net=module, **flags)
    assert run.losses == from_file.losses
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())     # the module is not trained
    assert run.history[0]["config"]["net"].startswith("module:Sequential#")
    with pytest.raises(ValueError, match=r"net= takes a preset name, a \.json file, 'path\.py:function' or a PyTorch "
                                         r"nn\.Module; got list \[1, 2\]"):
        hetconv.train(net=[1, 2], **flags)


def test_a_network_file_that_fails_to_import_shows_the_line_and_with_verbose_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\nSIZE = {}['width']\n\ndef build():\n    pass\n")
    code = coordinator.main(["--net", f"{bad}:build", "--local", "--steps", "1", "--batch-size", "16", *SMALL_FLAGS])
    err = capsys.readouterr().err
    assert code == 2 and f"importing {bad} raised KeyError: 'width' at {bad}:3: `SIZE = {{}}['width']`" in err, err
    assert "--- traceback ---" not in err
    coordinator.main(["--net", f"{bad}:build", "--local", "--steps", "1", "--batch-size", "16", "--verbose",
                      *SMALL_FLAGS])
    err = capsys.readouterr().err
    assert "--- traceback ---" in err and f'File "{bad}", line 3' in err, err
