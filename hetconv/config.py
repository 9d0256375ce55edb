"""The run's configuration: a flat list of defaults, one line each; flags override; unknown keys
raise; the whole config is saved with the run (metrics file and every checkpoint)."""
import argparse
import dataclasses
import json
from dataclasses import dataclass

from hetconv.geometry import IMAGE_SHAPE
from hetconv.wire import check_wire_dtype


@dataclass
class Config:
    # data and network
    data: str = "synthetic"            # 'synthetic' (built in) or a CIFAR-10 python-format dir / .tar.gz
    synthetic_train: int = 5000         # images in the built-in training set
    synthetic_test: int = 1000          # images in the built-in test set
    crop: int = 0                      # center-crop images to crop x crop (0: the full 32x32)
    conv: str = "500,1500"             # kernels per conv layer (the paper network: 500,1500)
    ksize: int = 5                     # conv kernel size (square), stride 1
    padding: int = 0                   # zero padding of every conv layer
    fc: str = "256"                    # hidden FC widths before the 10-way output ('' for none)
    # optimisation
    epochs: int = 1                    # passes over the training set
    steps: int = 0                     # stop after this many steps in total (0: run all epochs)
    batch_size: int = 128              # images per step
    lr: float = 0.01                   # SGD learning rate
    momentum: float = 0.9              # SGD momentum
    weight_decay: float = 5e-4         # L2 on weights (not on biases)
    seed: int = 0                      # initial weights and data order
    # devices
    threads: int = 0                   # threads per CPU device (0: every core this process may use)
    split: str = "proportional"        # 'proportional' to measured speed, or 'equal' (the naive baseline)
    use_all: bool = False              # keep every worker, even one whose fixed work makes the step slower
    calibration_batch: int = 16        # images per calibration run (real layer shapes otherwise)
    rebalance_after: int = 3           # every N steps, re-split from measured compute while it gains, up to 3 times (0: never)
    exchange: str = "peer"             # 'peer': workers pass feature maps among themselves; 'star': all through the coordinator
    micro_batches: int = 0             # pieces each batch is cut into so wire and compute overlap (0: auto, 1: none)
    wire_dtype: str = "float32"        # feature maps and gradients on the wire: float32 (exact), bfloat16 or float16
    snapshot_every: int = 0            # steps between in-memory snapshots a lost worker is recovered from (0: auto: at most 2 percent of step time)
    min_workers: int = 1               # below this many workers, checkpoint and stop instead of going on
    # output
    metrics: str = ""                  # JSON-lines metrics file ('' for none)
    checkpoint_dir: str = ""           # where checkpoints go ('' for none)
    checkpoint_every: int = 0          # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3          # newest checkpoints kept; older ones are deleted after each save
    eval_batches: int = 0              # test batches to evaluate at the end (0: the whole test set)

    def conv_kernels(self):
        return parse_int_list("--conv", self.conv, allow_empty=False)

    def fc_sizes(self):
        return parse_int_list("--fc", self.fc, allow_empty=True)

    def image_shape(self):
        c, h, w = IMAGE_SHAPE
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    def to_json(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}: expected some of {sorted(known)}")
        return cls(**d)

    def validate(self):
        self.conv_kernels()
        self.fc_sizes()
        checks = [("--epochs", self.epochs, 1), ("--batch-size", self.batch_size, 1), ("--steps", self.steps, 0),
                  ("--ksize", self.ksize, 1), ("--padding", self.padding, 0), ("--threads", self.threads, 0),
                  ("--calibration-batch", self.calibration_batch, 1), ("--checkpoint-every", self.checkpoint_every, 0),
                  ("--keep-checkpoints", self.keep_checkpoints, 1),
                  ("--synthetic-train", self.synthetic_train, 1), ("--synthetic-test", self.synthetic_test, 1),
                  ("--eval-batches", self.eval_batches, 0), ("--crop", self.crop, 0),
                  ("--rebalance-after", self.rebalance_after, 0), ("--micro-batches", self.micro_batches, 0),
                  ("--snapshot-every", self.snapshot_every, 0), ("--min-workers", self.min_workers, 1)]
        for flag, value, lowest in checks:
            if value < lowest:
                raise ValueError(f"{flag} must be >= {lowest}, got {value}")
        if self.rebalance_after == 1:
            raise ValueError("--rebalance-after must be 0 (never) or at least 2: step 1 pays for growing buffers "
                             "and is not measured")
        if self.crop > 32:
            raise ValueError(f"--crop must be at most the image size 32, got {self.crop}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.exchange not in ("peer", "star"):
            raise ValueError(f"--exchange must be 'peer' or 'star', got {self.exchange!r}")
        if self.micro_batches > self.batch_size:
            raise ValueError(f"--micro-batches {self.micro_batches} is more than the {self.batch_size} images of a batch")
        check_wire_dtype(self.wire_dtype)
        if self.split not in ("proportional", "equal"):
            raise ValueError(f"--split must be 'proportional' or 'equal', got {self.split!r}")
        return self


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


def add_config_flags(parser: argparse.ArgumentParser):
    """One flag per Config field, its default and its comment as help."""
    import inspect
    source = inspect.getsource(Config)
    comments = {}
    for line in source.splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            comments[line.split(":")[0].strip()] = line.split("#", 1)[1].strip()
    group = parser.add_argument_group("training")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            group.add_argument(flag, action="store_true", help=comments.get(f.name, ""))
            continue
        group.add_argument(flag, type=f.type, default=f.default,
                           help=f"{comments.get(f.name, '')} (default: {f.default!r})")


def config_from_args(args):
    return Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}).validate()


def dump(config):
    return json.dumps(config.to_json(), sort_keys=True)
