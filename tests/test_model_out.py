"""The model leaves: hetconv-eval gives the run's own test accuracy, hetconv-export's torch.export
program (run where hetconv cannot be imported), ONNX and .npz give hetconv's logits, and
hetconv-classify labels PNG files as the exported model does; bad input is one line, exit 2."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _exported import exported_logits
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.net import NetSpec
from hetconv.engine.shard import ConvShard
from hetconv.training.loop import train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")
from hetconv.cli import classify  # noqa: E402
from hetconv.cli import evaluate
from hetconv.training import trained_model
from hetconv.cli import export
from hetconv.net.torch_import import to_torch  # noqa: E402

RUN = dict(conv="4,8", fc="16", batch_size=16, steps=3, synthetic_train=64, synthetic_test=40, threads=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny network trained 3 steps into a checkpoint directory: (directory, train's summary)."""
    directory = tmp_path_factory.mktemp("run") / "ckpt"
    cfg = Config(**RUN, checkpoint_dir=str(directory)).validate()
    summary = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=lambda *_: None)
    return str(directory), summary


@pytest.fixture(scope="module")
def reference(run):
    """The test images as an exported model takes them (float32 in [0, 1]), their labels, and
    hetconv's own logits for them (in-process, as hetconv-eval computes them)."""
    model = trained_model.load_model(run[0])
    ds = trained_model.load_test_data(model)
    logits = trained_model.InProcessModel(model, threads=1).logits(model.normalize(ds.test_x))
    return ds.test_x.astype(np.float32) / 255, ds.test_y, logits


@pytest.fixture(scope="module")
def exported_torch(run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export") / "model.pt2")
    assert export.main([run[0], "--format", "torch", "--out", out]) == 0
    return out


def accuracy(logits, labels):
    return float((np.asarray(logits).argmax(axis=1) == labels).mean())


# ---- hetconv-eval -----------------------------------------------------------------------------

def test_eval_json_is_the_runs_own_test_evaluation(run, reference):
    directory, summary = run
    # another batch size than the run's: the result does not depend on it
    got = subprocess.run([sys.executable, "-m", "hetconv.cli.evaluate", directory, "--json", "--threads", "1",
                          "--batch-size", "7"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout)
    assert result["accuracy"] == summary["test_accuracy"]
    assert result["images"] == summary["test_images"] == RUN["synthetic_test"]
    x01, labels, logits = reference
    # the loss is the mean softmax cross-entropy of the same logits, as PyTorch computes it
    expected_loss = torch.nn.functional.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(labels))
    assert result["loss"] == pytest.approx(float(expected_loss), rel=1e-6)
    confusion = np.array(result["confusion"])
    predicted = logits.argmax(axis=1)
    np.testing.assert_array_equal(confusion, [[int(((labels == t) & (predicted == p)).sum()) for p in range(10)]
                                              for t in range(10)])
    assert [c["class"] for c in result["per_class"]] == list(trained_model.load_model(directory).classes)
    for t, c in enumerate(result["per_class"]):
        assert c["images"] == int((labels == t).sum())
        assert c["accuracy"] == pytest.approx(confusion[t, t] / c["images"])


def test_eval_table_names_every_class(run, capsys):
    assert evaluate.main([run[0], "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"accuracy {run[1]['test_accuracy']:.4f}" in out
    assert all(name in out for name in trained_model.load_model(run[0]).classes)
    assert "confusion" in out


def test_a_checkpoint_without_network_and_data_meta_is_read_with_named_assumptions(run, tmp_path):
    from hetconv.data import CIFAR10_CLASSES, CIFAR10_MEAN
    meta, conv, fc, _ = checkpoint.load_newest_valid(run[0])
    checkpoint.save(str(tmp_path), meta["step"], meta["epoch"], Config.from_json(meta["config"]), conv, fc)
    model = trained_model.load_model(str(tmp_path))
    assert model.spec == NetSpec.from_json(meta["network"])
    assert model.classes == list(CIFAR10_CLASSES) and model.data["mean"] == list(CIFAR10_MEAN)
    assert len(model.notes) == 2 and "network" in model.notes[0] and "CIFAR-10" in model.notes[1]


# ---- hetconv-export ---------------------------------------------------------------------------

def test_torch_export_runs_without_hetconv_and_gives_its_logits(run, reference, exported_torch, tmp_path):
    x01, labels, logits = reference
    exported = exported_logits(exported_torch, x01, tmp_path)
    np.testing.assert_allclose(exported, logits, atol=1e-4, rtol=0)
    assert accuracy(exported, labels) == run[1]["test_accuracy"]
    meta = {"data.json": "", "network.json": ""}              # the class names travel as the .npz's do
    torch.export.load(exported_torch, extra_files=meta)
    assert json.loads(meta["data.json"]) == checkpoint.load_newest_valid(run[0])[0]["data"]
    assert NetSpec.from_json(meta["network.json"]) == trained_model.load_model(run[0]).spec


def test_npz_export_loads_into_a_fresh_sequential(run, reference, tmp_path):
    x01, labels, logits = reference
    out = tmp_path / "model.npz"
    assert export.main([run[0], "--format", "npz", "--out", str(out)]) == 0
    with np.load(out, allow_pickle=False) as z:
        spec = NetSpec.from_json(str(z["network"]))
        data = json.loads(str(z["data"]))
        state = {name: torch.from_numpy(z[name]) for name in z.files if name not in ("network", "data")}
    assert data == checkpoint.load_newest_valid(run[0])[0]["data"]
    assert "0.weight" in state and all(a.dtype == torch.float32 for a in state.values())
    module = to_torch(spec, *spec.init_params(np.random.default_rng(1))).eval()     # other weights, then loaded
    module.load_state_dict(state, strict=True)
    mean = np.float32(data["mean"]).reshape(1, -1, 1, 1)
    std = np.float32(data["std"]).reshape(1, -1, 1, 1)
    with torch.no_grad():
        got = module(torch.from_numpy((x01 - mean) / std)).numpy()
    np.testing.assert_allclose(got, logits, atol=1e-4, rtol=0)
    assert accuracy(got, labels) == run[1]["test_accuracy"]


def test_onnx_export_gives_hetconv_logits(run, reference, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="ONNX export is an optional extra (pip install 'hetconv[onnx]')")
    pytest.importorskip("onnxscript", reason="ONNX export is an optional extra (pip install 'hetconv[onnx]')")
    x01, labels, logits = reference
    out = tmp_path / "model.onnx"
    assert export.main([run[0], "--format", "onnx", "--out", str(out)]) == 0
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": x01})[0]
    np.testing.assert_allclose(got, logits, atol=1e-4, rtol=0)
    assert accuracy(got, labels) == run[1]["test_accuracy"]


def test_every_export_carries_the_class_names_and_the_network_under_the_same_names(run, tmp_path):
    model = trained_model.load_model(run[0])
    texts = export.export_metadata(model)
    assert json.loads(texts["data.json"])["classes"] == list(model.classes)
    assert NetSpec.from_json(json.loads(texts["network.json"])) == model.spec
    out = tmp_path / "model.npz"
    assert export.main([run[0], "--format", "npz", "--out", str(out)]) == 0
    with np.load(out, allow_pickle=False) as z:
        assert (str(z["data"]), str(z["network"])) == (texts["data.json"], texts["network.json"])


def test_the_onnx_exporter_writes_the_metadata_into_the_model(run, tmp_path, monkeypatch):
    """Where onnx is not installed: the exporter's output read, given the metadata and written
    back, with torch.onnx and onnx stood in for (the real ones: the test below)."""
    import types
    written = {}

    def fake_export(module, args, out, **kwargs):
        with open(out, "wb") as f:
            f.write(b"model")
    proto = types.SimpleNamespace()
    fake_onnx = types.SimpleNamespace(
        load=lambda path: proto,
        helper=types.SimpleNamespace(set_model_props=lambda p, props: written.update(props)),
        save=lambda p, path: written.update(saved=(p is proto, str(path))))
    monkeypatch.setitem(sys.modules, "onnx", fake_onnx)
    monkeypatch.setitem(sys.modules, "onnxscript", types.SimpleNamespace())
    monkeypatch.setattr(torch.onnx, "export", fake_export)
    model = trained_model.load_model(run[0])
    export.export_onnx(model, str(tmp_path / "m.onnx"))
    assert written == {**export.export_metadata(model), "saved": (True, str(tmp_path / "m.onnx"))}


def test_an_onnx_export_carries_the_class_names_in_its_metadata_props(run, tmp_path):
    onnx = pytest.importorskip("onnx", reason="ONNX export is an optional extra (pip install 'hetconv[onnx]')")
    pytest.importorskip("onnxscript", reason="ONNX export is an optional extra (pip install 'hetconv[onnx]')")
    out = tmp_path / "model.onnx"
    assert export.main([run[0], "--format", "onnx", "--out", str(out)]) == 0
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert props == export.export_metadata(trained_model.load_model(run[0]))


# ---- hetconv-classify -------------------------------------------------------------------------

def test_classify_png_files_as_the_exported_model_does(run, reference, exported_torch, tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image", reason="reading images is an optional extra (pip install "
                                                   "'hetconv[images]')")
    x01, labels, _ = reference
    uint8 = np.rint(x01[:5] * 255).astype(np.uint8)
    paths = []
    for i, image in enumerate(uint8):
        paths.append(str(tmp_path / f"test{i}.png"))
        Image.fromarray(image.transpose(1, 2, 0)).save(paths[-1])
    assert classify.main([run[0], *paths, "--top", "10", "--json", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    module = torch.export.load(exported_torch).module()
    with torch.no_grad():
        probabilities = torch.softmax(module(torch.from_numpy(uint8.astype(np.float32) / 255)), dim=1).numpy()
    classes = trained_model.load_model(run[0]).classes
    assert [row["image"] for row in rows] == paths
    for row, p in zip(rows, probabilities):
        assert row["top"][0]["class"] == classes[int(p.argmax())]
        got = {c["class"]: c["probability"] for c in row["top"]}
        np.testing.assert_allclose([got[name] for name in classes], p, atol=1e-5)


def test_classify_converts_a_grey_image_to_the_networks_channels(run, tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image", reason="reading images is an optional extra")
    grey = np.arange(32 * 32, dtype=np.uint32).reshape(32, 32).astype(np.uint8)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    model = trained_model.load_model(run[0])
    np.testing.assert_array_equal(classify.read_image(str(tmp_path / "grey.png"), model), np.stack([grey] * 3))
    assert classify.main([run[0], str(tmp_path / "grey.png"), "--top", "2", "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'grey.png'}: ")


# ---- bad input: one line, exit 2 --------------------------------------------------------------

def checkpoint_of(directory, input_shape, classes):
    """A checkpoint of a one-conv network on `input_shape` images of `classes` classes."""
    spec = NetSpec.from_json({"input_shape": list(input_shape), "classes": classes, "layers": [
        {"type": "conv", "out_channels": 2, "kernel": 5}, {"type": "relu"}, {"type": "maxpool", "kernel": 2},
        {"type": "flatten"}, {"type": "linear", "out_features": classes}]})
    conv, fc = spec.init_params(np.random.default_rng(0))
    with_momentum = [[{"w": w, "b": b, "w.momentum_buffer": np.zeros_like(w), "b.momentum_buffer": np.zeros_like(b)}
                      for w, b in part] for part in (conv, fc)]
    data = {"name": "other", "classes": [f"c{i}" for i in range(classes)], "image_shape": list(input_shape),
            "mean": [0.5] * input_shape[0], "std": [0.25] * input_shape[0]}
    checkpoint.save(str(directory), 1, 0, Config(), *with_momentum, network=spec.to_json(), data=data)
    return str(directory)


def one_line_error(main, argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:                 # argparse's exit
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def bad_input_cases(run, tmp_path):
    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("hello")
    (tmp_path / "empty").mkdir()
    grey_28 = checkpoint_of(tmp_path / "grey28", (1, 28, 28), 10)
    five = checkpoint_of(tmp_path / "five", (3, 32, 32), 5)
    directory = run[0]
    return {
        "eval: missing file": (evaluate.main, [str(tmp_path / "nope.npz")], "nope.npz: no such checkpoint file"),
        "eval: not a checkpoint": (evaluate.main, [str(not_a_checkpoint)], "not a readable hetconv checkpoint"),
        "eval: no checkpoint in the directory": (evaluate.main, [str(tmp_path / "empty")], "no checkpoint"),
        "eval: data of another shape": (evaluate.main, [grey_28, "--data", "synthetic"],
                                        "--data synthetic: its images are 3x32x32, the model was trained on 1x28x28"),
        "eval: data of another class count": (evaluate.main, [five, "--data", "synthetic"],
                                              "--data synthetic: 10 classes, the model has 5"),
        "eval: missing data": (evaluate.main, [directory, "--data", str(tmp_path / "no-data")],
                               f"--data {tmp_path / 'no-data'}: "),
        "eval: batch size": (evaluate.main, [directory, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        "eval: unknown flag": (evaluate.main, [directory, "--bogus"], "unrecognized arguments: --bogus"),
        "classify: missing checkpoint": (classify.main, [str(tmp_path / "nope"), str(not_a_checkpoint)],
                                         "no such checkpoint file"),
        "classify: missing image": (classify.main, [directory, str(tmp_path / "nope.png")], "nope.png: no such file"),
        "classify: not an image": (classify.main, [directory, str(not_a_checkpoint)], "not a JPEG, PNG or WebP image"),
        "classify: top 0": (classify.main, [directory, str(not_a_checkpoint), "--top", "0"],
                            "--top must be 1..10 (the model's classes), got 0"),
        "classify: top over the classes": (classify.main, [directory, str(not_a_checkpoint), "--top", "11"],
                                           "--top must be 1..10"),
        "export: unknown format": (export.main, [directory, "--format", "keras", "--out", str(tmp_path / "m")],
                                   "argument --format: invalid choice: 'keras'"),
        "export: out is a directory": (export.main, [directory, "--format", "npz", "--out", str(tmp_path / "empty")],
                                       "is a directory; expected a file path"),
        "export: missing checkpoint": (export.main, [str(tmp_path / "nope"), "--format", "npz", "--out",
                                                     str(tmp_path / "m.npz")], "no such checkpoint file"),
        "export: out cannot be written": (export.main, [directory, "--format", "npz", "--out", "/proc/m.npz"],
                                          "--out '/proc/m.npz' cannot be written"),
    }


CASES = ["eval: missing file", "eval: not a checkpoint", "eval: no checkpoint in the directory",
         "eval: data of another shape", "eval: data of another class count", "eval: missing data",
         "eval: batch size", "eval: unknown flag", "classify: missing checkpoint", "classify: missing image",
         "classify: not an image", "classify: top 0", "classify: top over the classes", "export: unknown format",
         "export: out is a directory", "export: missing checkpoint", "export: out cannot be written"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2(case, run, tmp_path, capsys):
    main, argv, message = bad_input_cases(run, tmp_path)[case]
    if case.startswith("classify: not an image") or case == "classify: missing image":
        pytest.importorskip("PIL.Image", reason="reading images is an optional extra")
    assert message in one_line_error(main, argv, capsys)


def test_classify_takes_an_image_of_any_size_as_evaluation_would_crop_it(run, tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image", reason="reading images is an optional extra")
    from hetconv.data.photos import eval_image
    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), np.uint8)).save(tmp_path / "small.png")
    model = trained_model.load_model(run[0])
    # the shorter side to round(32 / 0.875) = 37, then the center 32 x 32
    np.testing.assert_array_equal(classify.read_image(tmp_path / "small.png", model),
                                  eval_image(str(tmp_path / "small.png"), 32))
    assert classify.main([run[0], str(tmp_path / "small.png"), "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'small.png'}: ")


def test_classify_labels_the_good_images_and_names_each_bad_one(run, tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image", reason="reading images is an optional extra")
    good = [str(tmp_path / f"good{i}.png") for i in range(2)]
    for i, path in enumerate(good):
        Image.fromarray(np.full((32, 32, 3), 40 * i, np.uint8)).save(path)
    Image.fromarray(np.zeros((20, 24), np.uint16)).save(tmp_path / "wide.png")        # 16-bit grey
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    argv = [good[0], str(tmp_path / "wide.png"), good[1], str(tmp_path / "broken.png")]
    assert classify.main([run[0], *argv, "--threads", "1"]) == 1
    captured = capsys.readouterr()
    assert [line.split(": ")[0] for line in captured.out.splitlines()] == good
    errors = captured.err.strip().splitlines()
    assert len(errors) == 2 and "Traceback" not in captured.err, captured.err
    assert "wide.png: Pillow mode 'I;16'" in errors[0] and "broken.png: not a JPEG, PNG or WebP" in errors[1]
    assert "1 when some were and any other was refused" in classify.build_parser().format_help().replace("\n", " ")


def test_missing_extras_are_named(run, tmp_path, capsys, monkeypatch):
    png = tmp_path / "x.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    monkeypatch.setitem(sys.modules, "PIL", None)             # import PIL raises ImportError
    assert "pip install 'hetconv[images]'" in one_line_error(classify.main, [run[0], str(png)], capsys)
    monkeypatch.setitem(sys.modules, "onnx", None)
    line = one_line_error(export.main, [run[0], "--format", "onnx", "--out", str(tmp_path / "m.onnx")], capsys)
    assert "needs the onnx package" in line and "pip install 'hetconv[onnx]'" in line
    assert not (tmp_path / "m.onnx").exists() and os.listdir(tmp_path) == ["x.png"]
