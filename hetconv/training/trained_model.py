"""A trained model as its checkpoint stores it: the network, the weights, the data set's classes
and normalisation; run in this process on one device (hetconv-eval, hetconv-classify,
hetconv-export)."""
from dataclasses import dataclass, field
import math

import numpy as np

from hetconv.data import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, load_dataset
from hetconv.devices import open_device
from hetconv.devices.cpu_options import CpuOptions
from hetconv.devices.cpu import HostArrays
from hetconv.engine.graph import graph_pass
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan
from hetconv.engine.shard import ConvShard
from hetconv.geometry import IMAGE_SHAPE, ConvSpec
from hetconv.net import NetSpec
from hetconv.net.head import Network
from hetconv.training import checkpoint


class ModelError(ValueError):
    """A checkpoint, data set or image that cannot be used with this model: one line, no traceback."""


# test-time augmentation: "flip" averages the logits of each image and of its left-right mirror,
# which costs a second forward pass
TTA = ("none", "flip")


@dataclass
class Model:
    path: str                   # the checkpoint file read
    step: int
    spec: NetSpec
    conv: list                  # [(w (K, C, kh, kw), b (K,) or None)] per conv layer
    fc: list                    # [(w (out, in), b (out,) or None)] per linear layer
    data: dict                  # name, classes, image_shape, mean, std (of [0, 1] pixels, per channel)
    config: dict
    notes: list = field(default_factory=list)
    conv_buffers: list = field(default_factory=list)   # per conv layer: its tail's BatchNorm state by name
    norms: list = field(default_factory=list)          # per BatchNorm between blocks (NetSpec.norm_nodes): its state

    def conv_states(self):
        """Per conv layer {name: array}: its weights (a zero bias where it has none) and its tail's
        BatchNorm state; then each BatchNorm's between blocks."""
        return [{"w": w, "b": np.zeros(len(w), np.float32) if b is None else b, **extra}
                for (w, b), extra in zip(self.conv, self.conv_buffers or [{} for _ in self.conv])] + list(self.norms)

    @property
    def classes(self):
        return list(self.data["classes"])

    def normalize(self, images):
        """uint8 images (N, C, H, W) -> float32 (x / 255 - mean) / std per channel, folded into one
        multiply-add as hetconv.data.normalize does, so the logits match the run's own evaluation."""
        c = images.shape[1]
        mean = np.asarray(self.data["mean"], np.float32).reshape(c, 1, 1)
        std = np.asarray(self.data["std"], np.float32).reshape(c, 1, 1)
        out = images.astype(np.float32)
        out *= 1.0 / (255.0 * std)
        out -= mean / std
        return out

    def crop(self, x):
        """(N, C, H, W) -> the network's input (N, C, h, w), centre-cropped as the run's evaluation
        crops (--crop); no copy when the sizes agree."""
        h, w = self.spec.input_shape[1:]
        if x.shape[2:] == (h, w):
            return x
        top, left = (x.shape[2] - h) // 2, (x.shape[3] - w) // 2
        return np.ascontiguousarray(x[:, :, top:top + h, left:left + w])


def _shape_text(shape):
    return "x".join(str(v) for v in shape)


def _check_data_meta(data, spec):
    """Raise ModelError unless `data` is a usable data meta for the network `spec`."""
    if not isinstance(data, dict):
        raise ModelError(f"its data meta is {type(data).__name__}, expected a JSON object")
    missing = [k for k in ("classes", "image_shape", "mean", "std") if k not in data]
    if missing:
        raise ModelError(f"its data meta has no {', '.join(missing)}")
    classes, shape = data["classes"], data["image_shape"]
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or len(classes) != spec.classes:
        raise ModelError(f"its data meta's classes must be {spec.classes} names (the network's outputs), "
                         f"got {str(classes)[:120]}")
    if (not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(v, int) and v >= 1 for v in shape)
            or shape[0] != spec.input_shape[0] or shape[1] < spec.input_shape[1] or shape[2] < spec.input_shape[2]):
        raise ModelError(f"its data meta's image_shape {shape} does not fit the network's input "
                         f"{_shape_text(spec.input_shape)}")
    for key in ("mean", "std"):
        v = data[key]
        if (not isinstance(v, list) or len(v) != shape[0]
                or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in v)
                or (key == "std" and min(v) <= 0)):
            raise ModelError(f"its data meta's {key} must be {shape[0]} finite numbers"
                             f"{' > 0' if key == 'std' else ''}, got {str(v)[:120]}")


def _cifar10_data_meta(config):
    name = config.get("data", "cifar10") if isinstance(config, dict) else "cifar10"
    return {"name": str(name), "classes": list(CIFAR10_CLASSES), "image_shape": list(IMAGE_SHAPE),
            "mean": list(CIFAR10_MEAN), "std": list(CIFAR10_STD)}


def load_model(path):
    """The model in the checkpoint `path` (a file, or a directory's newest valid checkpoint).
    Raises ModelError (one line naming the path) when it cannot be used. The arrays were checked
    against the network by checkpoint.load_newest_valid (names, dtypes, shapes, finite values)."""
    try:
        meta, conv_state, fc_state, _ = checkpoint.load_newest_valid(path)
        spec = checkpoint.network_of(meta)
    except checkpoint.CheckpointError as e:
        raise ModelError(str(e)) from None
    where = meta["path"]
    notes = []
    if "network" not in meta:
        notes.append("no network stored in the checkpoint: taken from the run's --conv/--fc/--ksize/--padding/"
                     "--crop on CIFAR-shaped images")
    if "data" in meta:
        data = meta["data"]
    else:
        data = _cifar10_data_meta(meta.get("config"))
        notes.append("no data meta stored in the checkpoint: assuming CIFAR-10's class names and "
                     "normalisation, which every run used before checkpoints kept them")
    try:
        _check_data_meta(data, spec)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
    conv_shapes, fc_shapes = spec.parameter_shapes()
    conv = [(state["w"], state["b"] if b_shape is not None else None)
            for state, (_, b_shape) in zip(conv_state, conv_shapes)]
    fc = [(state["w"], state["b"] if b_shape is not None else None) for state, (_, b_shape) in zip(fc_state, fc_shapes)]
    # what evaluation needs besides the conv weights: each tail's BatchNorm weights and statistics
    buffers = [{a.name: state[a.name] for a in ConvSpec.from_layer(layer).state_layout()[2:]}
               for layer, state in zip(spec.conv_layers(), conv_state)]
    norms = [{a.name: state[a.name] for a in norm.state_layout()}
             for norm, state in zip(spec.norm_specs(), conv_state[len(conv_shapes):])]
    return Model(where, int(meta["step"]), spec, conv, fc, data, meta.get("config") or {}, notes, buffers, norms)


class InProcessModel:
    """The model's forward pass in this process: the conv blocks on one CPU shard through the
    local engine (what `--local` trains with), the head on hetconv.model.Network."""

    def __init__(self, model, threads=None):

        spec = model.spec
        specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
        kernels = [s.kernels for s in specs]
        # the paths this machine timed before (devices.wisdom), as the run's own devices took them
        device = open_device("cpu", **CpuOptions(use_wisdom=True).device_options(threads))
        engine = LocalEngine({"local": ConvShard(device)})
        engine.configure(graph_pass(spec, HostArrays()))    # before load: it keeps the BatchNorm nodes' states
        engine.load(fixed_plan(kernels, {"local": kernels}), specs, model.conv_states())
        head = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
        self.net = Network(specs, head, engine, np.random.default_rng(0), spec.feature_shape(), fc_params=model.fc)

    def logits(self, x):
        """Normalised network inputs (N, C, H, W) float32 -> logits (N, classes) float32."""
        return self.net.predict(np.ascontiguousarray(x, np.float32))


def tta_logits(runner, x, tta="none"):
    """`runner`'s logits of normalised network inputs x (N, C, H, W) under the test-time
    augmentation `tta` (one of TTA)."""
    if tta not in TTA:
        raise ModelError(f"--tta must be one of {', '.join(TTA)}, got {tta!r}")
    logits = runner.logits(x)
    if tta == "flip":
        mirrored = runner.logits(np.ascontiguousarray(x[:, :, :, ::-1]))
        logits = (logits + mirrored) / np.float32(2)
    return logits


def log_softmax(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def load_test_data(model, spec=None, image_size=0, bad_images=None, loader_workers=0):
    """The data set to evaluate on: `spec` (as --data), else the one the run trained on, with the
    run's seed and sizes for the synthetic set; a photo folder's test split alone where it has one
    (its training photos are not read). `image_size` and `bad_images` (hetconv-eval's flags)
    override the run's: a folder of photos of any size read at `image_size`, and what its bad
    files do; `loader_workers` sets the pixel limit of the processes that will decode it. Raises
    ModelError when its images or classes do not fit the model."""
    config = model.config
    spec = spec or config.get("data") or model.data.get("name")
    if not spec:
        raise ModelError(f"{model.path}: no data set recorded with the run; give --data")
    options = {"test_only": True, "loader_workers": loader_workers}
    if spec == "synthetic":
        options = {"seed": int(config.get("seed", 0)), "n_train": config.get("synthetic_train"),
                   "n_test": config.get("synthetic_test")}
    photos = model.data.get("photos")
    if isinstance(photos, dict):
        # a photo folder: decoded with the run's evaluation transform to its --image-size, and its
        # --bad-images policy (a folder it skipped files of is read again the same way)
        options["image_size"] = int(photos.get("image_size") or model.data["image_shape"][1])
        options["bad_images"] = config.get("bad_images", "fail")
    if image_size:
        options["image_size"] = image_size
    if bad_images:
        options["bad_images"] = bad_images
    try:
        if spec == config.get("data") and config.get("val_split"):
            # the run held out part of its training images as the test split: the same part again
            options.update({"seed": int(config.get("seed", 0)), "val_split": float(config["val_split"])})
        ds = load_dataset(spec, **{k: v for k, v in options.items() if v is not None})
    except (ValueError, OSError) as e:
        raise ModelError(f"--data {spec}: {e}") from None
    shape = tuple(ds.test_x.shape[1:])
    if shape != tuple(model.data["image_shape"]):
        raise ModelError(f"--data {spec}: its images are {_shape_text(shape)}, the model was trained on "
                         f"{_shape_text(model.data['image_shape'])}")
    if len(ds.classes) != len(model.classes):
        raise ModelError(f"--data {spec}: {len(ds.classes)} classes, the model has {len(model.classes)}")
    if len(ds.test_y) == 0:
        raise ModelError(f"--data {spec}: its test split is empty")
    return ds


def evaluate(model, runner, images, labels, batch_size, progress=None, tta="none", batches=None):
    """Loss, accuracy, per-class accuracy and the confusion matrix (rows: true class, columns:
    predicted) of `runner` on uint8 images and their labels, under the test-time augmentation
    `tta` (one of TTA; the mirror is of the network's input, after --crop's centre crop).
    `batches`: (uint8 images, labels) pairs to take instead of slicing `images` and `labels` (a
    photo folder's, decoded in loader processes)."""
    k = len(model.classes)
    confusion = np.zeros((k, k), np.int64)
    loss_sum = 0.0
    if batches is None:
        batches = ((images[s:s + batch_size], labels[s:s + batch_size]) for s in range(0, len(labels), batch_size))
    for images_u8, y in batches:
        x = model.crop(model.normalize(images_u8))
        logits = tta_logits(runner, x, tta)
        loss_sum -= float(log_softmax(logits)[np.arange(len(y)), y].sum())
        np.add.at(confusion, (y, logits.argmax(axis=1)), 1)
        if progress is not None:
            progress.update(len(y))
    n = int(confusion.sum())
    per_class = []
    for i, name in enumerate(model.classes):
        seen = int(confusion[i].sum())
        per_class.append({"class": name, "images": seen, "correct": int(confusion[i, i]),
                          "accuracy": confusion[i, i] / seen if seen else None})
    return {"images": n, "loss": loss_sum / n, "accuracy": float(np.trace(confusion)) / n,
            "correct": int(np.trace(confusion)), "per_class": per_class, "confusion": confusion.tolist()}
