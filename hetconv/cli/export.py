"""hetconv-export: a checkpoint's model for use without hetconv.

    hetconv-export runs/a --format torch --out model.pt2    # torch.export program
    hetconv-export runs/a --format onnx --out model.onnx    # needs pip install 'hetconv[onnx]'
    hetconv-export runs/a --format npz --out model.npz      # nn.Sequential state_dict names, no pickle,
                                                            # and no PyTorch needed to write or read it

The torch and ONNX models take float32 NCHW images in [0, 1] of the network's input size (any
batch) and return logits: the normalisation (the data set's per-channel mean and std, stored in
the checkpoint) is inside, as buffers. The .npz holds the nn.Sequential's state_dict ("0.weight",
"3.bias", ..., float32, PyTorch's layouts) and, as JSON text (numpy str arrays, which load with
allow_pickle=False), the network ("network") and the data meta ("data": class names, image shape,
mean, std): NetSpec.from_json(str(z["network"])) and hetconv.net.torch_import.to_torch rebuild it.
The .pt2 carries the same two JSON texts as extra files, "data.json" and "network.json":
torch.export.load(path, extra_files={"data.json": ""}) fills the dict with them. The ONNX model
carries them as its metadata_props under the same names (onnxruntime:
session.get_modelmeta().custom_metadata_map["data.json"]).
"""
import io
import json
import logging
import os
import sys
import warnings

import numpy as np

from hetconv.flags import OneLineParser, add_version, check_output_file
from hetconv.net.torch_import import import_torch, to_torch
from hetconv.net.torch_import import state_dict as torch_state_dict
from hetconv.training.trained_model import ModelError, load_model

FORMATS = ("torch", "onnx", "npz")
ONNX_INSTALL = "pip install 'hetconv[onnx]' (in a checkout: pip install -e '.[onnx]')"


def sequential(model):
    """The model as PyTorch's nn.Sequential (state_dict keys by layer index), in eval mode."""
    return to_torch(model.spec, model.conv_states(), model.fc).eval()


def image_module(model):
    """An nn.Module from float32 NCHW images in [0, 1] to logits, the normalisation inside."""
    torch = import_torch()

    class NormalizedImages(torch.nn.Module):
        def __init__(self, net, mean, std):
            super().__init__()
            self.net = net
            c = len(mean)
            self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).reshape(1, c, 1, 1))
            self.register_buffer("std", torch.tensor(std, dtype=torch.float32).reshape(1, c, 1, 1))

        def forward(self, images):
            return self.net((images - self.mean) / self.std)

    return NormalizedImages(sequential(model), model.data["mean"], model.data["std"]).eval()


def _example(model, torch):
    # two images: torch.export specializes a batch of 1 to a constant
    return torch.rand((2,) + tuple(model.spec.input_shape), generator=torch.Generator().manual_seed(0))


def export_metadata(model):
    """The JSON texts every export carries beside the weights, by name: "data.json" (the class
    names, image shape, mean and std) and "network.json" (the network): a .pt2's extra files, an
    ONNX model's metadata_props, and a .npz's "data" and "network" arrays."""
    return {"data.json": json.dumps(model.data), "network.json": json.dumps(model.spec.to_json())}


def export_torch(model, out):
    torch = import_torch()
    module = image_module(model)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(module, (_example(model, torch),), dynamic_shapes={"images": {0: batch}})
    buffer = io.BytesIO()              # torch.export.save warns on a file name not ending in .pt2
    torch.export.save(program, buffer, extra_files=export_metadata(model))
    with open(out, "wb") as f:
        f.write(buffer.getbuffer())


def export_onnx(model, out):
    torch = import_torch()
    for package in ("onnx", "onnxscript"):           # torch.onnx writes through both
        try:
            __import__(package)
        except ImportError:
            raise ModelError(f"--format onnx needs the {package} package, which is not installed: "
                             f"{ONNX_INSTALL}") from None
    module = image_module(model)
    # the exporter logs every optional torchvision operator it skips, and onnxscript deprecations:
    # noise to someone exporting a CNN of plain layers
    onnx_log = logging.getLogger("torch.onnx")
    level = onnx_log.level
    onnx_log.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.onnx.export(module, (_example(model, torch),), out, input_names=["images"],
                              output_names=["logits"], dynamic_shapes={"images": {0: torch.export.Dim("batch", min=1)}},
                              dynamo=True, external_data=False, verbose=False)
    finally:
        onnx_log.setLevel(level)
    # written again with the metadata: the exporter takes none, and the model is small (the
    # weights are inside it, external_data=False)
    import onnx
    proto = onnx.load(out)
    onnx.helper.set_model_props(proto, export_metadata(model))
    onnx.save(proto, out)


def state_dict(model):
    """The nn.Sequential's state_dict (the one `sequential` builds) as numpy arrays, made without
    PyTorch: layer i's "i.weight", "i.bias" (none where the layer has no bias), a BatchNorm's
    "i.running_mean", "i.running_var" and "i.num_batches_tracked", in PyTorch's layouts."""
    return torch_state_dict(model.spec, model.conv_states(), model.fc)


def export_npz(model, out):
    state = state_dict(model)
    with open(out, "wb") as f:
        texts = export_metadata(model)
        np.savez(f, **state, network=np.array(texts["network.json"]), data=np.array(texts["data.json"]))


EXPORTERS = {"torch": export_torch, "onnx": export_onnx, "npz": export_npz}


def build_parser():
    p = OneLineParser(prog="hetconv-export",
                      description="Write a checkpoint's model for use without hetconv: a torch.export program "
                                  "(.pt2), ONNX, or a .npz of the nn.Sequential's state_dict. The torch and ONNX "
                                  "models take float32 NCHW images in [0, 1] and return logits.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_DIR",
                   help="a checkpoint file, or a directory (its newest valid checkpoint)")
    p.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    p.add_argument("--out", required=True, metavar="PATH", help="the file to write (replaced if it exists)")
    return add_version(p)


def check_args(args):
    """--out and --format, checked before the checkpoint is read: ModelError naming the flag."""
    if os.path.isdir(args.out):
        raise ModelError(f"--out {args.out!r} is a directory; expected a file path")
    try:
        check_output_file("--out", args.out)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if args.format != "npz":                         # a .npz is for readers without PyTorch
        try:
            import_torch()
        except ImportError as e:
            raise ModelError(f"--format {args.format}: {e}") from None


def write(model, args):
    """Write `model` in --format to --out. It is written beside the target, then renamed: a failed
    export leaves no half file under its name."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.out)), f".{os.path.basename(args.out)}.tmp")
    try:
        EXPORTERS[args.format](model, tmp)
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None):

    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        model = load_model(args.checkpoint)
        for note in model.notes:
            print(f"hetconv-export: note: {note}", file=sys.stderr)
        write(model, args)
    except ModelError as e:
        print(f"hetconv-export: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.format} export of {model.path} (step {model.step}); input float32 "
          f"Nx{'x'.join(map(str, model.spec.input_shape))} images in [0, 1], output logits over "
          f"{len(model.classes)} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
