"""hetconv from Python: train, then evaluate, predict with and export the trained model.

    import hetconv
    run = hetconv.train(net="lenet5", workers=["cpu", "cpu"], epochs=3, checkpoint_dir="runs/a")
    run.test_accuracy, run.history            # the done record; the metrics records
    model = run.model                         # or hetconv.load("runs/a")
    model.evaluate(data="synthetic")          # what hetconv-eval --json prints
    model.predict(images)                     # float NCHW in [0, 1] -> logits (N, classes)
    model.export("m.pt2", format="torch")     # torch | onnx | npz, as hetconv-export
    ds = hetconv.load_dataset("synthetic")    # the data set --data reads

Each call is its command. The keywords are the command's flags (dashes as underscores) and go
through that command's own parser and checks, so a bad one gets the command's own line, raised as
a ValueError instead of an exit (FlagError where the command's error is not one already). A
training run is the command's run: the same progress, the same answer to Ctrl-C, and every
worker it started ended however it ends.
"""
import dataclasses
import json
import os
import signal
import sys
import tempfile

import numpy as np

from hetconv.cli import coordinator
from hetconv.cli import evaluate as eval_command
from hetconv.cli import export as export_command
from hetconv.data import load_dataset as read_dataset
from hetconv.net.torch_import import forget_given_module, given_module_name
from hetconv.training import trained_model
from hetconv.training.trained_model import InProcessModel, ModelError, tta_logits


class FlagError(ValueError):
    """A keyword refused as the command refuses its flag: the command's own message, one line."""


# ---- keywords -> the command's flags -------------------------------------------------------------

def _text(value):
    """A keyword's value as its flag's text: a list or tuple as a comma list, a path as its
    string, a leading ~ expanded (as a shell does on the command line)."""
    if isinstance(value, (list, tuple)):
        return ",".join(_text(v) for v in value)
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    return os.path.expanduser(text) if text.startswith("~") else text


def command_line(parser, keywords, positional=()):
    """The argv that gives `keywords` to `parser`'s command: name=value as --name=value; a switch
    as its flag where True, left out where False; None left out (the flag's default). An unknown
    name goes in as it is, for the parser to refuse as it refuses the flag."""
    argv = [_text(p) for p in positional]
    # argparse lists its flags only in _actions: the one way to tell a switch (no value) from the rest
    switches = {flag: action for action in parser._actions if action.nargs == 0 for flag in action.option_strings}
    for name, value in keywords.items():
        flag = "--" + name.replace("_", "-")
        action = switches.get(flag)
        if action is not None and action.dest in ("help", "version"):
            raise FlagError(f"{flag} is for the command line; from Python, help() on the function says the same")
        if value is None:
            continue
        if action is None:
            argv.append(f"{flag}={_text(value)}")
        elif isinstance(value, bool):
            argv += [flag] if value else []
        else:
            raise FlagError(f"{flag} is a switch: give {name}=True or False, got {value!r}")
    return argv


def parse(parser, argv):
    """`parser`'s namespace for `argv`; where the command would print its error and exit, FlagError
    with the same message."""
    def refuse(message):
        raise FlagError(message)
    parser.error = refuse
    return parser.parse_args(argv)


# ---- training --------------------------------------------------------------------------------------

class Run:
    """A training run as it ended: the done record's values, every training loss, the metrics
    records (`history`, as --metrics writes them) and the trained model (from its checkpoint)."""

    def __init__(self, summary, history):
        self.summary = dict(summary)        # what the training loop returned
        self.history = history              # [{"event": "config" | "plan" | "step" | "eval" | ..., ...}]
        self._model = None

    step = property(lambda self: self.summary.get("step"))
    test_accuracy = property(lambda self: self.summary.get("test_accuracy"))
    test_loss = property(lambda self: self.summary.get("test_loss"))
    final_loss = property(lambda self: self.summary.get("final_loss"))
    median_step_s = property(lambda self: self.summary.get("median_step_s"))
    checkpoint = property(lambda self: self.summary.get("checkpoint"))          # the newest it wrote, or None
    losses = property(lambda self: list(self.summary.get("losses", [])))        # per step, this start's
    interrupted = property(lambda self: bool(self.summary.get("interrupted")))

    @property
    def model(self):
        """The model in the newest checkpoint this run wrote (read once)."""
        if self._model is None:
            if not self.checkpoint:
                raise ModelError("this run wrote no checkpoint, so it kept no model: give hetconv.train "
                                 "checkpoint_dir=DIR (--checkpoint-dir)")
            self._model = load(self.checkpoint)
        return self._model

    def __repr__(self):
        if self.interrupted:
            return f"Run(stopped at step {self.step}, checkpoint={self.checkpoint!r})"
        return (f"Run(step={self.step}, test_accuracy={self.test_accuracy:.4f}, test_loss={self.test_loss:.4f}, "
                f"checkpoint={self.checkpoint!r})")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped a training run as it stops the command: the running step
    finished, a checkpoint written where checkpoint_dir was given, every worker ended. A
    KeyboardInterrupt, so a loop of runs stops too; `run` is the Run as far as it got."""

    def __init__(self, run):
        self.run = run
        code = run.summary.get("exit_code", 130)
        name = signal.Signals(code - 128).name if code > 128 else "a stop"
        super().__init__(f"{name} stopped the run at step {run.step}"
                         + (f"; checkpoint {run.checkpoint}" if run.checkpoint else "; nothing was saved"))


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(*, workers=None, **flags):
    """Train as hetconv-coordinator does with these flags, in this process; returns a Run.

    Every keyword is a hetconv-coordinator flag, dashes as underscores (batch_size=32 is
    --batch-size 32; local=True is --local; a list is a comma list: conv=[4, 8]). net= also takes
    a PyTorch nn.Module: traced as --net FILE.py:FUNCTION's module is, its current weights the
    start (the module itself is not changed). `workers`, a list
    of devices such as ["cpu", "cuda:0"], is --spawn; an int is --workers (external workers).
    Bad keywords and values are refused as the flags are (ValueError, the command's line). With
    no metrics= the metrics records are kept in a temporary file, read back as `run.history`.

    Ctrl-C (or SIGTERM) finishes the step, checkpoints where checkpoint_dir is given, ends the
    workers and raises Interrupted (a KeyboardInterrupt) holding the Run. A failed run raises
    the command's error (a worker's WorkerError, FloatingPointError, ...). Every worker this call
    started has ended when it returns or raises.
    """
    if workers is not None:
        if "spawn" in flags:
            raise FlagError("workers= and spawn= both give the --spawn list: give one")
        flags["workers" if isinstance(workers, int) and not isinstance(workers, bool) else "spawn"] = workers
    given = _given_module(flags)
    try:
        return _train(flags)
    finally:
        if given:
            forget_given_module(given)


def _given_module(flags):
    """net=: an nn.Module becomes the --net text that stands for it in this process (returned,
    else None); anything but a text or a path is refused naming it."""
    net = flags.get("net")
    if net is None or isinstance(net, (str, os.PathLike)):
        return None
    torch = sys.modules.get("torch")           # an nn.Module means torch is imported already
    if torch is None or not isinstance(net, torch.nn.Module):
        raise FlagError(f"net= takes a preset name, a .json file, 'path.py:function' or a PyTorch nn.Module; "
                        f"got {type(net).__name__} {net!r:.100}")
    flags["net"] = given_module_name(net)
    return flags["net"]


def _train(flags):
    parser = coordinator.build_parser()
    argv = command_line(parser, flags)
    args = parse(parser, argv)
    with tempfile.TemporaryDirectory(prefix="hetconv-run-") as scratch:
        args.metrics = args.metrics or os.path.join(scratch, "metrics.jsonl")
        try:
            prepared = coordinator.prepare(args, argv)
        except coordinator.CHECK_ERRORS as e:
            if isinstance(e, ValueError):       # DataError, CheckpointError, ...: the command's line as it is
                raise
            raise FlagError(str(e)) from None  # a device list or Ray address: refused all the same
        summary = coordinator.run(args, prepared)
        run = Run(summary, _records(args.metrics))
    if run.interrupted:
        raise Interrupted(run)
    return run


# ---- the trained model -----------------------------------------------------------------------------

@dataclasses.dataclass(repr=False, eq=False)
class Model(trained_model.Model):
    """A trained model as its checkpoint holds it (network, weights, class names, normalisation),
    run in this process on the CPU; no worker is needed."""
    _runners: dict = dataclasses.field(default_factory=dict)     # threads -> InProcessModel, made once

    def __repr__(self):
        return (f"Model({self.path!r}, step {self.step}, input {'x'.join(map(str, self.spec.input_shape))}, "
                f"{len(self.classes)} classes)")

    def _runner(self, threads):
        if threads not in self._runners:
            self._runners[threads] = InProcessModel(self, threads=threads or None)
        return self._runners[threads]

    def evaluate(self, data="", batch_size=256, threads=0, tta="none"):
        """What `hetconv-eval CHECKPOINT --json` prints, as a dict: loss, accuracy, correct,
        images, per-class accuracy and the confusion matrix on a data set's test split. Keywords
        are hetconv-eval's flags: data (default: the one the run trained on), batch_size, threads
        (0: every usable core), tta ("flip": each image's logits averaged with its mirror's)."""
        parser = eval_command.build_parser()
        args = parse(parser, command_line(parser, {"data": data, "batch_size": batch_size, "threads": threads,
                                                   "tta": tta}, [self.path]))
        eval_command.check_args(args)
        ds = trained_model.load_test_data(self, args.data)
        return eval_command.evaluation(self, ds, args)

    def _checked_images(self, images):
        """`images` as a float32 array the network takes, else ModelError saying what was expected."""
        x = np.asarray(images)
        c, h, w = self.spec.input_shape
        sizes = {(h, w), tuple(self.data["image_shape"][1:])}       # the run's crop input, or whole images
        expected = " or ".join(f"(N, {c}, {hh}, {ww})" for hh, ww in sorted(sizes))
        if x.dtype.kind != "f":
            hint = " (8-bit pixels: divide by 255)" if x.dtype.kind in "ui" else ""
            raise ModelError(f"images: expected float pixels in [0, 1], got dtype {x.dtype}{hint}")
        if x.ndim != 4 or x.shape[1] != c or tuple(x.shape[2:]) not in sizes:
            hint = " (one image: images[None])" if x.ndim == 3 else ""
            raise ModelError(f"images: expected shape {expected}, got {x.shape}{hint}")
        if x.size:
            low, high = float(x.min()), float(x.max())
            if not (0 <= low and high <= 1):                   # nan fails both
                hint = " (0..255 pixels: divide by 255)" if high > 1 and np.isfinite(high) else ""
                raise ModelError(f"images: pixel values must be in [0, 1], got {low:g} to {high:g}{hint}")
        return x.astype(np.float32, copy=False)

    def predict(self, images, batch_size=256, threads=0, tta="none"):
        """Logits (N, classes) float32 of float NCHW images with pixels in [0, 1], of the network's
        input size or, for a run trained with --crop, of the data set's (centre-cropped as its
        evaluation does); normalised with the data set's mean and std, as the exports do inside.
        `tta` "flip" averages each image's logits with its mirror's. Run in batches of batch_size."""
        for name, value, low in (("batch_size", batch_size, 1), ("threads", threads, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ModelError(f"{name} must be an integer >= {low}, got {value!r}")
        x = self._checked_images(images)
        channels = x.shape[1]
        mean = np.asarray(self.data["mean"], np.float32).reshape(1, channels, 1, 1)
        std = np.asarray(self.data["std"], np.float32).reshape(1, channels, 1, 1)
        out = [np.zeros((0, len(self.classes)), np.float32)]
        for start in range(0, len(x), batch_size):
            batch = self.crop((x[start:start + batch_size] - mean) / std)
            out.append(tta_logits(self._runner(threads), batch, tta))
        return np.concatenate(out)

    def export(self, path, format="torch"):
        """Write the model as `hetconv-export CHECKPOINT --format FORMAT --out PATH` does: "torch"
        (a torch.export program, .pt2), "onnx" or "npz" (nn.Sequential state_dict names, no
        pickle). The torch and ONNX models take float32 NCHW images in [0, 1]. Returns the path."""
        parser = export_command.build_parser()
        args = parse(parser, command_line(parser, {"format": format, "out": path}, [self.path]))
        export_command.check_args(args)
        export_command.write(self, args)
        return args.out


def load(path):
    """The model in a checkpoint file, or a directory's newest valid checkpoint (as hetconv-eval
    reads it). ModelError (a ValueError) naming the path where it cannot be used."""
    loaded = trained_model.load_model(_text(path))
    for note in loaded.notes:
        print(f"hetconv: note: {note}", file=sys.stderr)
    return Model(**{f.name: getattr(loaded, f.name) for f in dataclasses.fields(trained_model.Model)})


def load_dataset(spec, **options):
    """The data set --data `spec` reads: "synthetic" (the built-in set, with the commands' default
    seed and sizes) or a path (~ expanded) to CIFAR-10/100, MNIST-style IDX files, an image folder
    or a .npz. A DataSet: train_x, test_x (uint8 NCHW), train_y, test_y (int64), classes, mean, std.
    options: seed, n_train, n_test, labels (CIFAR-100: "fine" or "coarse"), fashion (IDX)."""
    return read_dataset(_text(spec), **options)
