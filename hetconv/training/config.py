"""The run's configuration: a flat list of defaults, one line each; flags override; unknown keys
raise; the whole config is saved with the run (metrics file and every checkpoint)."""
import argparse
import dataclasses
from dataclasses import dataclass, field

from hetconv.data.batches import parse_augment
from hetconv.data.photos import MAX_IMAGE_SIZE
from hetconv.devices.cpu import CONV_PATHS as CPU_CONV_PATHS, PRECISIONS
from hetconv.devices.wisdom import FILE_NAME as WISDOM_FILE
from hetconv.engine.costmodel import parse_bandwidth
from hetconv.engine.planner import POLICIES, check_parallel
from hetconv.flags import check_finite, parse_int_list
from hetconv.geometry import IMAGE_SHAPE
from hetconv.net import LoadedNet, NetSpec, load_net
from hetconv.training.recipe import parse_betas, parse_milestones
from hetconv.training.schedule import KINDS
from hetconv.transport.wire import check_wire_dtype
from hetconv.update import ADAM_FAMILY, OPTIMIZER_NAMES, OPTIMIZERS, parse_no_decay

# the fields that fix the network's shape: a checkpoint resumes only into the same ones
NETWORK_FIELDS = ("net", "conv", "fc", "ksize", "padding", "crop", "image_size")


PAPER_FAMILY_DEFAULTS = {"conv": "500,1500", "fc": "256", "ksize": 5, "padding": 0}


def option(default, help):
    """A Config field: its default, and its help text for the command line."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # data and network
    data: str = option("synthetic", "'synthetic' (built in), or a path: CIFAR-10/100 (python format, dir or .tar.gz), a dir of "
                                    "MNIST-style IDX files, an image folder (ROOT/train/CLASS/*.jpg, ROOT/val/... or "
                                    "ROOT/test/...; photos of any size with --image-size), a .npz")
    image_size: int = option(0, "an image folder of photos of any size (JPEG, PNG, WebP): the network's input size S; "
                                "photos are decoded as they stream, resized and cropped to S x S (training: see "
                                "--augment; evaluation: the shorter side to round(S/0.875), then the center). 0: an "
                                "image folder's images all have one size and are held in memory")
    bad_images: str = option("fail", "photos that cannot be read (truncated, corrupt, 16-bit, decompression bombs, "
                                     "files that are not photos, empty class directories): 'fail' refuses the folder "
                                     "naming them; 'skip' leaves them out and says how many, and refuses a "
                                     "training class left with no photo")
    loader_workers: int = option(0, "processes that decode a photo folder's batches (0: auto: the cores the compute "
                                    "leaves, at least 1; the run says what it chose; more than the usable cores is "
                                    "capped to them, saying so)")
    val_split: float = option(0.0, "for a data set with no test split (an image folder without test/, a .npz without "
                                   "x_test): hold out this fraction of the training images, per class and picked by "
                                   "--seed, as its test split (0: off; refused for a data set that has a test split)")
    synthetic_train: int = option(5000, "images in the built-in training set")
    synthetic_test: int = option(1000, "images in the built-in test set")
    crop: int = option(0, "center-crop images to crop x crop, at most their size (0: the data set's whole images)")
    net: str = option("", "the network: a preset (paper, lenet5, cifar10-quick, vgg-small, vgg-small-bn, airbench94, "
                          "resnet9, resnet18, preact-resnet18, inception-small, mobilenet_v2, resnext29, and ImageNet's "
                          "resnet34, resnet50; NAME@WIDTH scales its widths), a .json file of layers "
                          "or nodes, or FILE.py:FUNCTION returning a PyTorch module, sequential or traceable with "
                          "residual sums and concatenations (its weights are the starting weights); '': the paper "
                          "family that --conv, --fc, --ksize and --padding describe")
    conv: str = option("500,1500", "kernels per conv layer (the paper network: 500,1500)")
    ksize: int = option(5, "conv kernel size (square), stride 1")
    padding: int = option(0, "zero padding of every conv layer")
    fc: str = option("256", "hidden FC widths before the output layer, which has one output per class of the data "
                            "('' for none)")
    # optimisation
    epochs: int = option(1, "passes over the training set")
    steps: int = option(0, "stop after this many steps in total (0: run all epochs)")
    batch_size: int = option(128, "images per step")
    lr: float = option(0.01, "learning rate (a schedule's peak)")
    optimizer: str = option("sgd", "'sgd' (torch.optim.SGD), 'adamw' (torch.optim.AdamW) or 'adam' (torch.optim.Adam)")
    momentum: float = option(0.9, "SGD momentum")
    nesterov: bool = option(False, "SGD with Nesterov momentum")
    betas: str = option("0.9,0.999", "Adam(W)'s beta1,beta2")
    eps: float = option(1e-8, "Adam(W)'s eps")
    weight_decay: float = option(5e-4, "weight decay: coupled (L2 in the gradient) for sgd and adam, decoupled for "
                                       "adamw")
    no_decay: str = option("bias", "parameter groups without weight decay: a comma list of bias (every bias, "
                                   "BatchNorm's too) and norm (normalisation weights); '' to decay everything")
    schedule: str = option("constant", "the learning rate over the run's steps, as PyTorch's scheduler of that name: "
                                       "constant; step (MultiStepLR: --milestones, --gamma); cosine "
                                       "(CosineAnnealingLR to --min-lr); onecycle (OneCycleLR with --lr as its peak, "
                                       "momentum cycled 0.95 to 0.85 and back)")
    warmup_steps: int = option(0, "a linear warm-up from 0 over this many steps before the schedule")
    milestones: str = option("", "--schedule step: the steps at which the rate is multiplied by --gamma, e.g. 30,60")
    gamma: float = option(0.1, "--schedule step: the factor at each milestone")
    min_lr: float = option(0.0, "--schedule cosine: the rate it ends at")
    label_smoothing: float = option(0.0, "label smoothing of the cross-entropy, as F.cross_entropy's")
    clip_grad_norm: float = option(0.0, "clip the global gradient norm (every parameter, head and conv together) to "
                                        "this, as clip_grad_norm_ (0: off)")
    bn_ghost_batch: int = option(0, "BatchNorm statistics over groups of this many consecutive images of a batch "
                                    "(ghost batches), each group as PyTorch's BatchNorm2d run on it in turn; 0: the "
                                    "whole batch, whatever the split and the micro-batches")
    seed: int = option(0, "initial weights and data order")
    # devices
    threads: int = option(0, "threads per CPU device (0: every core this process may use; under --deterministic "
                             "a --plan's recorded count, else 1)")
    cpu_conv_path: str = option("auto", "a CPU device's conv path: 'auto' (per layer and share, the fastest by timing on "
                                        "first use), or forced: 'im2col', 'shifted' or 'fft' (stride-1 layers), or "
                                        "'im2col-dnnl' (oneDNN's sgemm), 'direct-dnnl' (oneDNN's own convolutions), "
                                        "'depthwise' (Numba kernels for depthwise convs; other convs im2col), 'winograd' "
                                        "(F(4x4,3x3) on 3x3 stride-1 convs; others by the rule)")
    precision: str = option("fp32", "a CPU device's conv GEMMs: fp32; bf16 (operands rounded to bf16, sums and "
                                    "everything else in fp32, as PyTorch's autocast; needs oneDNN: pip install "
                                    "'hetconv[onednn]'; emulated, slower, on a CPU without bf16 instructions); auto (bf16 where the device's timing finds it faster, per "
                                    "layer and share, else fp32; the log and the metrics' precision records say "
                                    "per layer which ran). GPU devices run fp32")
    retime: bool = option(False, "time every CPU device's conv paths again, and store the result over the "
                                 f"machine's wisdom ($HETCONV_CACHE/{WISDOM_FILE}, default ~/.cache/hetconv): "
                                 "without it a call shape timed before on this machine reuses its path (a resumed "
                                 "run runs its checkpoint's paths either way)")
    deterministic: bool = option(False, "conv paths by a fixed rule, no timing; the plan fixed; the same command "
                                        "gives the same bits (slower: see README)")
    plan: str = option("", "run this plan instead of calibrating one: an earlier run's --metrics file (its last plan "
                           "record: the split, the modes and the micro-batch count) or a plan JSON; the same worker "
                           "names (--spawn gives the same ones each time). With --deterministic, the same bits as "
                           "that run; without --plan, --deterministic splits equally")
    split: str = option("proportional", "'proportional' to measured speed, or 'equal' (the naive baseline)")
    parallel: str = option("auto", "per conv layer, 'model' (kernels split among workers) or 'data' (images split, "
                                   "whole weights on every worker); 'auto': the cost model picks per layer; or a "
                                   "letter per conv layer, M or D, such as DDMM")
    link: str = option("1gbit", "the workers' network, which --parallel auto prices the modes on: a line rate such as "
                                "100mbit, 1gbit or 10gbit, or payload bytes per second such as 500MB")
    use_all: bool = option(False, "keep every worker, even one whose fixed work makes the step slower")
    calibration_batch: int = option(16, "images per calibration run (real layer shapes otherwise)")
    rebalance_after: int = option(3, "every N steps, re-split from measured compute while it gains, up to 3 times (0: never)")
    exchange: str = option("peer", "'peer': workers pass feature maps among themselves; 'star': all through the coordinator")
    micro_batches: int = option(0, "pieces each batch is cut into so wire and compute overlap (0: auto: up to batch/16, at most 4, "
                                     "fewer where the cost model prices fewer faster; 1: none)")
    wire_dtype: str = option("auto", "feature maps and gradients on the wire: float32 (exact), bfloat16 or float16 "
                                     "(half the bytes, rounded); auto: bfloat16 where every CPU worker's conv GEMMs "
                                     "run bf16 (--precision bf16, or auto where calibration took bf16), else float32")
    snapshot_every: int = option(0, "steps between in-memory snapshots a lost worker is recovered from (0: auto: at most 2 percent of step time)")
    min_workers: int = option(1, "below this many workers, checkpoint and stop instead of going on")
    # output
    metrics: str = option("", "JSON-lines metrics file ('' for none)")
    trace_step: int = option(3, "the training step (from 1) whose timeline each worker records in the metrics, where "
                                "workers trade slices (--exchange peer): its blocks' forward and backward, its waits "
                                "for what they read, its updates; hetconv-report draws it (0: none)")
    checkpoint_dir: str = option("", "where checkpoints go ('' for none)")
    checkpoint_every: int = option(0, "steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = option(3, "newest checkpoints kept; older ones are deleted after each save")
    eval_batches: int = option(0, "test batches each evaluation reads (0: the whole test set)")
    eval_every: int = option(1, "evaluate on the test set every N epochs, and at the end (0: only at the end)")
    augment: str = option("", "training images: a comma list of crop (a random crop of the image padded by 4 "
                              "pixels), flip (a random horizontal flip) and, for a photo folder, random-resized-crop "
                              "(torchvision's RandomResizedCrop: 8 to 100 percent of the area, ratio 3/4-4/3); '' for none "
                              "(a photo folder: the shorter side resized to --image-size, then the center)")

    def conv_kernels(self):
        return parse_int_list("--conv", self.conv, allow_empty=False)

    def fc_sizes(self):
        return parse_int_list("--fc", self.fc, allow_empty=True)

    def augment_kinds(self):
        """--augment as a tuple of kinds, each once, in the order given."""
        return parse_augment(self.augment)

    def dataset_options(self):
        """load_dataset's keywords for this run's --data."""
        synthetic = self.data == "synthetic"
        return {"seed": self.seed, "n_train": self.synthetic_train if synthetic else None,
                "n_test": self.synthetic_test if synthetic else None, "val_split": self.val_split,
                "image_size": self.image_size, "bad_images": self.bad_images, "loader_workers": self.loader_workers}

    def image_shape(self):
        c, h, w = IMAGE_SHAPE
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    def input_shape(self, data_shape):
        """(C, H, W) entering the network: the data set's images, center-cropped by --crop."""
        c, h, w = data_shape
        if self.crop and (self.crop > h or self.crop > w):
            raise ValueError(f"--crop {self.crop} is larger than the data set's {h}x{w} images")
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    def network(self, input_shape, classes):
        """The network for a data set of `input_shape` images and `classes` classes, as a
        hetconv.net LoadedNet (its spec, and starting weights where a PyTorch module gave them)."""
        if self.net:
            changed = [f"--{k}" for k, v in PAPER_FAMILY_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"--net {self.net} names the whole network: {', '.join(changed)} describe the paper "
                                 f"family instead; give one or the other")
            return load_net(self.net, input_shape, classes)
        layers = []
        for k in self.conv_kernels():
            layers += [{"type": "conv", "out_channels": k, "kernel": self.ksize, "padding": self.padding},
                       {"type": "relu"}, {"type": "maxpool", "kernel": 2}]
        layers.append({"type": "flatten"})
        for width in self.fc_sizes():
            layers += [{"type": "linear", "out_features": width}, {"type": "relu"}]
        layers.append({"type": "linear", "out_features": classes})
        try:
            return LoadedNet(NetSpec.from_json({"input_shape": list(input_shape), "classes": classes,
                                                "layers": layers}))
        except ValueError as e:
            raise ValueError(f"--conv {self.conv} --ksize {self.ksize} --padding {self.padding} on "
                             f"{'x'.join(map(str, input_shape))} images: {e}") from None

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
        if self.cpu_conv_path not in CPU_CONV_PATHS:
            raise ValueError(f"--cpu-conv-path must be one of {', '.join(CPU_CONV_PATHS)}, got {self.cpu_conv_path!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.precision == "bf16" and self.cpu_conv_path not in ("auto", "direct-dnnl"):
            raise ValueError(f"--precision bf16 runs every CPU conv on its bf16 path: --cpu-conv-path "
                             f"{self.cpu_conv_path} cannot be forced with it (direct-dnnl can: oneDNN's "
                             f"convolutions in bf16)")
        self.conv_kernels()
        self.fc_sizes()
        self.augment_kinds()
        for f in dataclasses.fields(self):
            if f.type in (float, "float"):
                check_finite("--" + f.name.replace("_", "-"), getattr(self, f.name))
        checks = [("--epochs", self.epochs, 1), ("--batch-size", self.batch_size, 1), ("--steps", self.steps, 0),
                  ("--ksize", self.ksize, 1), ("--padding", self.padding, 0), ("--threads", self.threads, 0),
                  ("--calibration-batch", self.calibration_batch, 1), ("--checkpoint-every", self.checkpoint_every, 0),
                  ("--keep-checkpoints", self.keep_checkpoints, 1),
                  ("--synthetic-train", self.synthetic_train, 1), ("--synthetic-test", self.synthetic_test, 1),
                  ("--eval-batches", self.eval_batches, 0), ("--eval-every", self.eval_every, 0),
                  ("--crop", self.crop, 0), ("--image-size", self.image_size, 0),
                  ("--loader-workers", self.loader_workers, 0),
                  ("--rebalance-after", self.rebalance_after, 0), ("--micro-batches", self.micro_batches, 0),
                  ("--snapshot-every", self.snapshot_every, 0), ("--min-workers", self.min_workers, 1),
                  ("--seed", self.seed, 0), ("--trace-step", self.trace_step, 0)]
        for flag, value, lowest in checks:
            if value < lowest:
                raise ValueError(f"{flag} must be >= {lowest}, got {value}")
        if self.rebalance_after == 1:
            raise ValueError("--rebalance-after must be 0 (never) or at least 2: step 1 pays for growing buffers "
                             "and is not measured")
        if self.image_size and self.crop > self.image_size:
            raise ValueError(f"--crop {self.crop} is larger than --image-size {self.image_size}")
        if self.image_size > MAX_IMAGE_SIZE:
            raise ValueError(f"--image-size must be at most {MAX_IMAGE_SIZE}, got {self.image_size}")
        if "random-resized-crop" in self.augment_kinds() and not self.image_size:
            raise ValueError("--augment random-resized-crop applies to a photo folder: give --image-size S")
        if self.bad_images not in ("fail", "skip"):
            raise ValueError(f"--bad-images must be 'fail' or 'skip', got {self.bad_images!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.val_split < 1:
            raise ValueError(f"--val-split must be in [0, 1), got {self.val_split}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        self.check_recipe()
        if self.exchange not in ("peer", "star"):
            raise ValueError(f"--exchange must be 'peer' or 'star', got {self.exchange!r}")
        if self.micro_batches > self.batch_size:
            raise ValueError(f"--micro-batches {self.micro_batches} is more than the {self.batch_size} images of a batch")
        check_wire_dtype(self.wire_dtype)
        if self.split not in POLICIES:
            raise ValueError(f"--split must be one of {', '.join(POLICIES)}, got {self.split!r}")
        check_parallel(self.parallel)
        try:
            parse_bandwidth(self.link)
        except ValueError as e:
            raise ValueError(f"--link: {e}") from None
        return self

    def check_recipe(self):
        """The optimizer, schedule, loss and clipping flags, each checked with one line naming it."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("--nesterov needs --optimizer sgd with a --momentum above 0 (as torch.optim.SGD)")
        parse_betas(self.betas)
        parse_no_decay(self.no_decay)
        if self.schedule not in KINDS:
            raise ValueError(f"--schedule must be one of {', '.join(KINDS)}, got {self.schedule!r}")
        milestones = parse_milestones(self.milestones)
        if milestones and self.schedule != "step":
            raise ValueError(f"--milestones applies to --schedule step, not {self.schedule}")
        if self.schedule == "step" and not milestones:
            raise ValueError("--schedule step needs --milestones, the steps at which the rate drops, e.g. 30,60")
        for flag, value, low in (("--eps", self.eps, 0.0), ("--gamma", self.gamma, 0.0), ("--min-lr", self.min_lr, 0.0),
                                 ("--clip-grad-norm", self.clip_grad_norm, 0.0), ("--warmup-steps", self.warmup_steps, 0)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low:g}, got {value}")
        if self.eps == 0 and self.optimizer in ADAM_FAMILY:
            raise ValueError(f"--eps must be > 0 with --optimizer {self.optimizer} (it keeps the update finite)")
        if self.min_lr and self.schedule != "cosine":
            raise ValueError(f"--min-lr {self.min_lr:g} applies to --schedule cosine, not {self.schedule}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}: cosine annealing goes down to it")
        if not 0 <= self.label_smoothing <= 1:
            raise ValueError(f"--label-smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.bn_ghost_batch < 0 or self.bn_ghost_batch == 1 or self.bn_ghost_batch > self.batch_size:
            raise ValueError(f"--bn-ghost-batch must be 0 (the whole batch) or from 2 to --batch-size "
                             f"{self.batch_size}, got {self.bn_ghost_batch}")

    def check_given(self, given):
        """The flags the command line gave (`given`: Config field names, whatever their values) that
        this config would ignore: each refused in one line naming it, its value and what would make
        it count. Returns notes (lines) for a flag that counts only in part."""
        def refuse(name, why):
            if name in given:
                value = getattr(self, name)
                shown = f"{value:g}" if isinstance(value, float) else repr(value) if value == "" else value
                raise ValueError(f"--{name.replace('_', '-')} {shown} {why}")
        if self.optimizer == "sgd":
            refuse("betas", "applies to --optimizer adamw or adam, not sgd")
            refuse("eps", "applies to --optimizer adamw or adam, not sgd")
        else:
            refuse("momentum", f"applies to --optimizer sgd, not {self.optimizer} ({OPTIMIZER_NAMES[self.optimizer]}'s "
                               f"momentum is the beta1 of --betas)")
        if self.schedule == "onecycle":
            refuse("momentum", "has no effect with --schedule onecycle: it cycles the momentum from 0.95 to 0.85 "
                               "and back (drop --momentum, or use another --schedule)")
        if self.schedule != "step":
            refuse("gamma", f"applies to --schedule step, not {self.schedule}")
        if self.schedule != "cosine":
            refuse("min_lr", f"applies to --schedule cosine, not {self.schedule}")
        if self.weight_decay == 0:
            refuse("no_decay", "has no effect with --weight-decay 0: no parameter is decayed")
        if self.bn_ghost_batch == self.batch_size:
            refuse("bn_ghost_batch", f"is the whole --batch-size {self.batch_size}: one statistics group, as 0 "
                                     f"(the default) makes; give fewer images per group")
        notes = []
        if self.schedule == "onecycle" and self.optimizer in ADAM_FAMILY and "betas" in given:
            notes.append(f"note: --schedule onecycle cycles {OPTIMIZER_NAMES[self.optimizer]}'s beta1 from 0.95 to "
                         f"0.85 and back: --betas {self.betas} sets only its beta2, {parse_betas(self.betas)[1]:g}")
        return notes

    def check_same_network(self, saved):
        """Raise unless `saved` (a Config) describes the same network as this one."""
        for key in NETWORK_FIELDS:
            then, now = getattr(saved, key), getattr(self, key)
            if then != now:
                raise ValueError(f"the checkpoint was trained with --{key.replace('_', '-')} {then!r}, "
                                 f"this run asks for {now!r}")


def add_config_flags(parser: argparse.ArgumentParser, names=None, title="training"):
    """One flag per Config field (or per field in `names`): its default, and its help from the
    field's metadata."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(Config):
        if names is None or f.name in names:
            flag = "--" + f.name.replace("_", "-")
            if f.type in (bool, "bool"):
                group.add_argument(flag, action="store_true", help=f.metadata["help"])
                continue
            group.add_argument(flag, type=f.type, default=f.default,
                               choices=POLICIES if f.name == "split" else None, help=f.metadata["help"])
    return group


def config_from_args(args):
    return Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}).validate()
