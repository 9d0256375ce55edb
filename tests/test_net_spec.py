"""The network as data: stored form, checks that name the layer, inferred sizes, presets, --net."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from hetconv.net import PRESETS, ConvBlock, NetSpec, load_net, preset
from hetconv.net.spec import Conv, Flatten, Linear, Pool, ReLU

PAPER_JSON = {"input_shape": [3, 32, 32], "classes": 10, "layers": [
    {"type": "conv", "out_channels": 500, "kernel": [5, 5], "stride": [1, 1], "padding": [0, 0], "bias": True},
    {"type": "relu"},
    {"type": "maxpool", "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0]},
    {"type": "conv", "out_channels": 1500, "kernel": [5, 5]},
    {"type": "relu"},
    {"type": "maxpool", "kernel": [2, 2]},
    {"type": "flatten"},
    {"type": "linear", "out_features": 256},
    {"type": "relu"},
    {"type": "dropout", "p": 0.5},
    {"type": "linear", "out_features": 10}]}


def small(layers, input_shape=(3, 16, 16), classes=10):
    """A stored form with these layers (dicts), for the checks below."""
    return {"input_shape": list(input_shape), "classes": classes, "layers": layers}


CONV = {"type": "conv", "out_channels": 4, "kernel": 3}
FLAT = {"type": "flatten"}
OUT = {"type": "linear", "out_features": 10}


# ---- stored form ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("input_shape", [(3, 32, 32), (1, 28, 28)])
def test_every_preset_survives_json(name, input_shape):
    spec = preset(name, input_shape, 10, width=0.25)
    text = json.dumps(spec.to_json())
    again = NetSpec.from_json(text)
    assert again == spec
    assert again.to_json() == spec.to_json()
    assert NetSpec.from_json(json.loads(text)) == spec


def test_the_documented_example_reads_with_its_defaults():
    spec = NetSpec.from_json(PAPER_JSON)
    assert spec.layers[3] == Conv(1500, (5, 5), (1, 1), (0, 0), True)
    assert spec.layers[5] == Pool("max", (2, 2), (2, 2), (0, 0))
    assert spec.to_json()["layers"][5] == {"type": "maxpool", "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0]}
    assert spec.head()[0].in_features == 1500 * 5 * 5


def test_ints_stand_for_pairs():
    spec = NetSpec.from_json(small([{"type": "conv", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1},
                                    {"type": "avgpool", "kernel": 2}, FLAT, OUT]))
    assert spec.layers[0].kernel == (3, 3) and spec.layers[0].stride == (2, 2) and spec.layers[0].padding == (1, 1)
    assert spec.layers[1] == Pool("avg", 2, 2, 0)


# ---- per-channel layers after a conv, in any order ---------------------------------------------------

def test_a_conv_takes_any_sequence_of_per_channel_layers_and_the_device_fuses_what_it_can():
    """airbench94's order (pool, then BatchNorm, then GELU) and VGG-BN's (BatchNorm, ReLU, pool):
    a relu right after the conv and then a pool go into the fused block, the rest is the tail."""
    spec = NetSpec.from_json(small([
        CONV, {"type": "maxpool", "kernel": 2}, {"type": "batchnorm"}, {"type": "gelu"},
        {"type": "conv", "out_channels": 6, "kernel": 3, "bias": False}, {"type": "batchnorm", "momentum": None},
        {"type": "relu"}, {"type": "avgpool", "kernel": 2}, {"type": "dropout2d", "p": 0.1},
        {"type": "conv", "out_channels": 8, "kernel": 1}, {"type": "relu"}, {"type": "maxpool", "kernel": 1},
        {"type": "silu"}, {"type": "global_avgpool"},
        FLAT, {"type": "linear", "out_features": 10, "bias": False}, {"type": "scale", "factor": 1 / 9}]))
    first, second, third = spec.conv_layers()
    assert (first.block.activation, first.block.pool) == ("none", "max")
    assert [op.type for op in first.tail] == ["batchnorm", "activation"] and first.tail[1].kind == "gelu"
    assert (second.block.activation, second.block.pool) == ("none", "none")
    assert [op.type for op in second.tail] == ["batchnorm", "activation", "pool", "dropout2d"]
    assert second.tail[0].momentum is None and not second.bias
    assert (third.block.activation, third.block.pool) == ("relu", "max")
    assert [op.type for op in third.tail] == ["activation", "global_pool"]
    assert third.output_shape == (8, 1, 1) and spec.head()[0].in_features == 8
    assert NetSpec.from_json(spec.to_json()) == spec
    assert "batchnorm" in spec.describe() and "scale 0.111111" in spec.describe()


# ---- every violation names the layer ---------------------------------------------------------------

BAD = [
    ("relu before any conv", [{"type": "relu"}, CONV, FLAT, OUT], "layer 0 (relu)", "first layer must be conv"),
    ("no conv at all", [FLAT, OUT], "layer 0 (flatten)", "first layer must be conv"),
    ("batchnorm after flatten", [CONV, FLAT, {"type": "batchnorm"}, OUT], "layer 2 (batchnorm)",
     "after flatten only linear"),
    ("scale before the classifier", [CONV, FLAT, {"type": "scale", "factor": 2}, OUT], "layer 2 (scale)",
     "only after the last linear"),
    ("batchnorm momentum above 1", [CONV, {"type": "batchnorm", "momentum": 2}, FLAT, OUT], "layer 1 (batchnorm)",
     "momentum must be a number in [0, 1]"),
    ("gelu with a slope", [CONV, {"type": "gelu", "negative_slope": 0.2}, FLAT, OUT], "layer 1 (gelu)",
     "unknown key 'negative_slope'"),
    ("gelu approximated otherwise", [CONV, {"type": "gelu", "approximate": "erf"}, FLAT, OUT], "layer 1 (gelu)",
     "approximate must be one of"),
    ("linear before flatten", [CONV, OUT], "layer 1 (linear)", "flatten before the FC part"),
    ("two flattens", [CONV, FLAT, FLAT, OUT], "layer 2 (flatten)", "only one flatten"),
    ("conv after flatten", [CONV, FLAT, CONV, OUT], "layer 2 (conv)", "after flatten only linear"),
    ("pool after flatten", [CONV, FLAT, {"type": "maxpool", "kernel": 2}, OUT], "layer 2 (maxpool)",
     "after flatten only linear"),
    ("relu right after flatten", [CONV, FLAT, {"type": "relu"}, OUT], "layer 2 (relu)", "must follow a linear"),
    ("two activations in the head", [CONV, FLAT, {"type": "linear", "out_features": 8}, {"type": "relu"},
                                     {"type": "dropout", "p": 0.1}, {"type": "relu"}, OUT],
     "layer 5 (relu)", "must follow a linear"),
    ("two dropouts", [CONV, FLAT, {"type": "dropout", "p": 0.1}, {"type": "dropout", "p": 0.1}, OUT],
     "layer 3 (dropout)", "two dropouts"),
    ("no flatten", [CONV, {"type": "relu"}], "layer 1 (relu)", "followed by one flatten"),
    ("ends on relu", [CONV, FLAT, OUT, {"type": "relu"}], "layer 3 (relu)", "must end with a linear"),
    ("last linear not classes", [CONV, FLAT, {"type": "linear", "out_features": 7}], "layer 2 (linear)",
     "out_features 7, expected classes = 10"),
    ("unknown type", [CONV, {"type": "layernorm"}, FLAT, OUT], "layer 1 (layernorm)", "unknown type 'layernorm'"),
    ("unknown key", [{"type": "conv", "out_channels": 4, "kernel": 3, "transposed": True}, FLAT, OUT],
     "layer 0 (conv)", "unknown key 'transposed'"),
    ("key on a relu", [CONV, {"type": "relu", "inplace": True}, FLAT, OUT], "layer 1 (relu)", "unknown key 'inplace'"),
    ("missing kernel", [{"type": "conv", "out_channels": 4}, FLAT, OUT], "layer 0 (conv)", "missing key 'kernel'"),
    ("zero kernels", [{"type": "conv", "out_channels": 0, "kernel": 3}, FLAT, OUT], "layer 0 (conv)",
     "out_channels must be an integer >= 1, got 0"),
    ("fractional kernel", [{"type": "conv", "out_channels": 4, "kernel": 2.5}, FLAT, OUT], "layer 0 (conv)",
     "kernel must be an integer or a pair"),
    ("three-sided kernel", [{"type": "conv", "out_channels": 4, "kernel": [3, 3, 3]}, FLAT, OUT], "layer 0 (conv)",
     "kernel must be an integer or a pair"),
    ("negative padding", [{"type": "conv", "out_channels": 4, "kernel": 3, "padding": -1}, FLAT, OUT],
     "layer 0 (conv)", "padding must be an integer >= 0"),
    ("zero stride", [CONV, {"type": "maxpool", "kernel": 2, "stride": 0}, FLAT, OUT], "layer 1 (maxpool)",
     "stride must be an integer >= 1"),
    ("pool padding over half its window", [CONV, {"type": "maxpool", "kernel": 2, "padding": 2}, FLAT, OUT],
     "layer 1 (maxpool)", "at most half the kernel"),
    ("bias not a bool", [{"type": "conv", "out_channels": 4, "kernel": 3, "bias": "yes"}, FLAT, OUT],
     "layer 0 (conv)", "bias must be true or false"),
    ("dropout p of 1", [CONV, FLAT, {"type": "dropout", "p": 1.0}, OUT], "layer 2 (dropout)", "in [0, 1)"),
    ("negative dropout", [CONV, FLAT, {"type": "dropout", "p": -0.1}, OUT], "layer 2 (dropout)", "in [0, 1)"),
    ("window larger than input", [{"type": "conv", "out_channels": 4, "kernel": 17}, FLAT, OUT], "layer 0 (conv)",
     "kernel 17x17 does not fit its 16x16 input with padding 0"),
    ("pool larger than what is left", [{"type": "conv", "out_channels": 4, "kernel": 13},
                                       {"type": "maxpool", "kernel": 5}, FLAT, OUT],
     "layer 1 (maxpool)", "kernel 5x5 does not fit its 4x4 input"),
    ("a layer without a type", [CONV, {"p": 0.5}, FLAT, OUT], "layer 1 (no type)", "unknown type None"),
    ("a type that is not a name", [CONV, {"type": ["relu"]}, FLAT, OUT], "layer 1 (['relu'])",
     "unknown type ['relu']; expected one of conv, relu"),
    ("a layer that is not an object", [CONV, "relu", FLAT, OUT], "layer 1 (str)", "must be an object"),
]


@pytest.mark.parametrize("layers, where, what", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_each_violation_names_the_layer_and_what_was_expected(layers, where, what):
    with pytest.raises(ValueError) as e:
        NetSpec.from_json(small(layers))
    message = str(e.value)
    assert message.startswith(where + ":"), message
    assert what in message, message


def test_padding_makes_a_window_fit():
    spec = NetSpec.from_json(small([{"type": "conv", "out_channels": 4, "kernel": 17, "padding": 1}, FLAT, OUT]))
    assert spec.conv_layers()[0].output_shape == (4, 2, 2)


@pytest.mark.parametrize("data, what", [
    ({"input_shape": [3, 16, 16], "classes": 10, "layers": [CONV, FLAT, OUT], "optimizer": "sgd"},
     "unknown key 'optimizer'"),
    ({"input_shape": [3, 16, 16], "layers": [CONV, FLAT, OUT]}, "no 'classes'"),
    ({"input_shape": [3, 16], "classes": 10, "layers": [CONV, FLAT, OUT]}, "input_shape must be"),
    ({"input_shape": [3, 16, 16], "classes": 0, "layers": [CONV, FLAT, OUT]}, "classes must be an integer >= 1"),
    ({"input_shape": [3, 16, 16], "classes": 10, "layers": []}, "no layers"),
    ([CONV, FLAT, OUT], "must be a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_the_network_itself_is_checked(data, what):
    with pytest.raises(ValueError) as e:
        NetSpec.from_json(data)
    assert what in str(e.value), str(e.value)


def test_a_network_built_in_code_is_checked_as_one_read_from_json():
    with pytest.raises(ValueError, match=r"^layer 3 \(relu\)"):
        NetSpec((3, 16, 16), 10, (Conv(4, 3), Pool("max", 2), Flatten(), ReLU(), Linear(10)))
    with pytest.raises(ValueError, match=r"^layer 1 \(str\)"):
        NetSpec((3, 16, 16), 10, (Conv(4, 3), "relu", Flatten(), Linear(10)))


# ---- shapes -------------------------------------------------------------------------------------------

# (preset, input) -> the (C, H, W) leaving each conv block, then the flatten size
SHAPES = {
    ("paper", (3, 32, 32)): ([(500, 14, 14), (1500, 5, 5)], 37500),
    ("paper", (1, 28, 28)): ([(500, 12, 12), (1500, 4, 4)], 24000),
    ("lenet5", (3, 32, 32)): ([(6, 16, 16), (16, 6, 6)], 576),
    ("lenet5", (1, 28, 28)): ([(6, 14, 14), (16, 5, 5)], 400),
    ("cifar10-quick", (3, 32, 32)): ([(32, 16, 16), (32, 8, 8), (64, 4, 4)], 1024),
    ("cifar10-quick", (1, 28, 28)): ([(32, 14, 14), (32, 7, 7), (64, 4, 4)], 1024),
    ("vgg-small", (3, 32, 32)): ([(32, 32, 32), (32, 16, 16), (64, 16, 16), (64, 8, 8), (128, 8, 8), (128, 4, 4),
                                  (256, 4, 4), (256, 2, 2)], 1024),
    ("vgg-small", (1, 28, 28)): ([(32, 28, 28), (32, 14, 14), (64, 14, 14), (64, 7, 7), (128, 7, 7), (128, 3, 3),
                                  (256, 3, 3), (256, 1, 1)], 256),
}


@pytest.mark.parametrize("name, input_shape", sorted(SHAPES))
def test_shapes_are_inferred_for_each_preset(name, input_shape):
    blocks, flat = SHAPES[name, input_shape]
    spec = preset(name, input_shape, 10)
    convs = spec.conv_layers()
    assert [c.output_shape for c in convs] == blocks
    assert convs[0].input_shape == input_shape and convs[0].in_channels == input_shape[0]
    for before, after in zip(convs, convs[1:]):
        assert after.input_shape == before.output_shape and after.in_channels == before.kernels
    head = spec.head()
    assert head[0].type == "flatten" and head[0].in_features == head[0].out_features == flat
    linears = [op for op in head if op.type == "linear"]
    assert linears[0].in_features == flat and linears[-1].out_features == 10


def test_conv_blocks_carry_their_activation_and_pool():
    spec = preset("cifar10-quick", (3, 32, 32), 10)
    blocks = [c.block for c in spec.conv_layers()]
    assert blocks[0] == ConvBlock(stride=(1, 1), padding=(2, 2), activation="relu", pool="max", pool_kernel=(3, 3),
                                  pool_stride=(2, 2), pool_padding=(1, 1))
    assert [b.pool for b in blocks] == ["max", "avg", "avg"]
    bare = NetSpec.from_json(small([CONV, CONV, {"type": "relu"}, FLAT, OUT]))
    first, second = bare.conv_layers()
    assert (first.block.activation, first.block.pool) == ("none", "none")
    assert (second.block.activation, second.block.pool) == ("relu", "none")
    assert first.output_shape == (4, 14, 14) and second.input_shape == (4, 14, 14)


def test_head_lists_the_fc_part_with_its_widths():
    spec = NetSpec.from_json(PAPER_JSON)
    assert [(op.type, op.in_features, op.out_features) for op in spec.head()] == [
        ("flatten", 37500, 37500), ("linear", 37500, 256), ("relu", 256, 256), ("dropout", 256, 256),
        ("linear", 256, 10)]


def test_with_input_resizes_for_another_data_set():
    spec = preset("lenet5", (3, 32, 32), 10)
    mnist = spec.with_input((1, 28, 28), 26)
    assert mnist == preset("lenet5", (1, 28, 28), 26)
    assert mnist.layers[:-1] == spec.layers[:-1]
    assert mnist.parameter_shapes()[1][0][0] == (120, 400)
    with pytest.raises(ValueError, match=r"layer 0 \(conv\).*does not fit"):
        preset("paper", (3, 32, 32), 10).with_input((3, 4, 4), 10)


def test_width_scales_every_conv_and_hidden_fc_but_not_the_classes():
    spec = preset("vgg-small", (3, 32, 32), 10, width=0.25)
    assert [c.kernels for c in spec.conv_layers()] == [8, 8, 16, 16, 32, 32, 64, 64]
    assert [op.out_features for op in spec.head() if op.type == "linear"] == [64, 10]
    tiny = preset("lenet5", (1, 28, 28), 10, width=0.01)
    assert [c.kernels for c in tiny.conv_layers()] == [1, 1]


# ---- parameters ------------------------------------------------------------------------------------

def test_parameter_shapes_follow_pytorch_layouts():
    spec = preset("lenet5", (1, 28, 28), 10)
    conv, fc = spec.parameter_shapes()
    assert conv == [((6, 1, 5, 5), (6,)), ((16, 6, 5, 5), (16,))]
    assert fc == [((120, 400), (120,)), ((84, 120), (84,)), ((10, 84), (10,))]
    no_bias = NetSpec.from_json(small([dict(CONV, bias=False), FLAT,
                                       {"type": "linear", "out_features": 10, "bias": False}]))
    assert no_bias.parameter_shapes() == ([((4, 3, 3, 3), None)], [((10, 784), None)])


def test_init_params_is_pytorchs_default_and_seeded():
    spec = preset("lenet5", (1, 28, 28), 10)
    conv, fc = spec.init_params(np.random.default_rng(0))
    again, _ = spec.init_params(np.random.default_rng(0))
    assert all(np.array_equal(w, w2) and np.array_equal(b, b2) for (w, b), (w2, b2) in zip(conv, again))
    for (w, b), (w_shape, b_shape) in zip(conv + fc, sum(spec.parameter_shapes(), [])):
        assert w.shape == w_shape and b.shape == b_shape and w.dtype == b.dtype == np.float32
        bound = 1 / np.sqrt(np.prod(w_shape[1:]))
        # kaiming-uniform with a=sqrt(5) is uniform in +-1/sqrt(fan_in); biases share the bound
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
        assert np.abs(b).max() <= bound and np.abs(b).max() > 0.5 * bound


def test_describe_has_a_line_per_layer_with_shape_and_parameters():
    spec = preset("paper", (3, 32, 32), 10)
    lines = spec.describe().splitlines()
    assert len(lines) == len(spec.layers) + 2
    assert "500x28x28" in lines[1] and "38,000" in lines[1]
    assert "37500" in lines[7] and "9,600,256" in lines[8]


# ---- --net ---------------------------------------------------------------------------------------

def test_load_net_reads_presets_widths_and_json(tmp_path):
    assert load_net("paper", (3, 32, 32), 10).spec == preset("paper", (3, 32, 32), 10)
    loaded = load_net("vgg-small@0.25", (3, 32, 32), 100)
    assert loaded.spec == preset("vgg-small", (3, 32, 32), 100, width=0.25) and loaded.params is None
    path = tmp_path / "net.json"
    path.write_text(json.dumps(PAPER_JSON))
    assert load_net(str(path), (3, 32, 32), 10).spec == NetSpec.from_json(PAPER_JSON)
    # the stored layers hold no input size: a data set of another shape re-sizes them
    assert load_net(str(path), (1, 28, 28), 10).spec.head()[0].in_features == 24000


@pytest.mark.parametrize("text, what", [
    ("resnet101", "not a preset nor an existing file"),
    ("vgg-small@", "width after @ must be a positive number"),
    ("vgg-small@-1", "width after @ must be a positive number"),
    ("vgg-small@nan", "width after @ must be a positive number"),
    ("missing.json", "cannot read it"),
    ("", "expected a preset"),
])
def test_load_net_names_the_text_and_what_is_accepted(text, what):
    with pytest.raises(ValueError) as e:
        load_net(text, (3, 32, 32), 10)
    assert what in str(e.value) and repr(text)[1:-1] in str(e.value)


def test_load_net_refuses_a_bad_json_file_naming_it(tmp_path):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(PAPER_JSON)[:-5])
    with pytest.raises(ValueError, match=r"net\.json: the network is not valid JSON"):
        load_net(str(path), (3, 32, 32), 10)
    path.write_text(json.dumps(PAPER_JSON))
    with pytest.raises(ValueError, match=r"net\.json: the network has 10 classes, the data set 100"):
        load_net(str(path), (3, 32, 32), 100)
    with pytest.raises(ValueError, match=r"net\.json on input 3x8x8: layer 3 \(conv\): kernel 5x5 does not fit"):
        load_net(str(path), (3, 8, 8), 10)


@pytest.mark.parametrize("input_shape, what", [
    (32, "on input 32 with 10 classes: input_shape must be [channels, height, width], got 32"),
    ((3, 32), "on input 3x32 with 10 classes: input_shape must be [channels, height, width], got (3, 32)"),
    ((3, 32, 32.5), "on input 3x32x32.5 with 10 classes: input_shape must be an integer >= 1, got 32.5"),
])
def test_load_net_refuses_a_bad_input_shape_in_one_line(input_shape, what):
    with pytest.raises(ValueError) as e:
        load_net("paper", input_shape, 10)
    assert str(e.value) == "--net paper " + what
    with pytest.raises(ValueError, match=r"^input_shape must be"):
        preset("lenet5", (1, 28, 28), 10).with_input(input_shape, 10)


def test_load_net_refuses_a_preset_too_deep_for_the_input():
    # 8 -> 4 -> 2 -> 1 after three stages: the fourth stage's pool has nothing to pool
    expected = r"--net vgg-small on input 3x8x8 with 10 classes: layer 19 \(maxpool\): kernel 2x2 does not fit its 1x1"
    with pytest.raises(ValueError, match=expected):
        load_net("vgg-small", (3, 8, 8), 10)


# ---- PyTorch stays optional ------------------------------------------------------------------------

def test_a_missing_torch_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    from hetconv.net.torch_import import import_torch
    monkeypatch.setitem(sys.modules, "torch", None)        # what an environment without torch imports
    with pytest.raises(ImportError, match=r"pip install 'hetconv\[torch\]'"):
        import_torch()
    path = tmp_path / "mynet.py"
    path.write_text("def build():\n    return None\n")
    with pytest.raises(ValueError, match=r"^--net .*mynet\.py:build: PyTorch is not installed.*hetconv\[torch\]"):
        load_net(f"{path}:build", (3, 32, 32), 10)


def test_presets_and_json_never_import_torch():
    code = ("import sys, hetconv.net as n\n"
            "s = n.load_net('vgg-small@0.25', (3, 32, 32), 10).spec\n"
            "n.NetSpec.from_json(s.to_json()).init_params(__import__('numpy').random.default_rng(0))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---- graphs ---------------------------------------------------------------------------------------

def _node(name, inputs, **layer):
    return {"name": name, "inputs": inputs, **layer}


RESIDUAL = {"input_shape": [3, 8, 8], "classes": 10, "nodes": [
    _node("stem", ["input"], type="conv", out_channels=4, kernel=3, padding=1),
    _node("stem_relu", ["stem"], type="relu"),
    _node("a", ["stem_relu"], type="conv", out_channels=4, kernel=3, padding=1, bias=False),
    _node("a_bn", ["a"], type="batchnorm"),
    _node("sum", ["a_bn", "stem_relu"], type="add"),
    _node("out", ["sum"], type="relu"),
    _node("b", ["out"], type="conv", out_channels=2, kernel=1),
    _node("cat", ["b", "out"], type="concat"),
    _node("pool", ["cat"], type="maxpool", kernel=2),
    _node("flatten", ["pool"], type="flatten"),
    _node("fc", ["flatten"], type="linear", out_features=10)]}


def test_a_graph_reads_its_nodes_infers_shapes_and_splits_into_blocks_and_joins():
    spec = NetSpec.from_json(json.dumps(RESIDUAL))
    assert not spec.is_chain()
    assert spec.output_shapes()[spec.names.index("cat")] == (6, 8, 8)
    assert spec.feature_shape() == (6, 4, 4) and spec.head()[1].in_features == 96
    blocks = spec.conv_layers()
    # the stem's relu is fused into its block; a_bn stays in a's block; the sum, its relu, the
    # concatenation and the pool join blocks on the coordinator
    assert [(spec.names[b.index], b.block.activation, [t.type for t in b.tail], b.source, b.node) for b in blocks] == [
        ("stem", "relu", [], -1, 1), ("a", "none", ["batchnorm"], 1, 3), ("b", "none", [], 5, 6)]
    assert [(st.kind, spec.names[st.output]) for st in spec.graph_steps()] == [
        ("block", "stem_relu"), ("block", "a_bn"), ("node", "sum"), ("node", "out"), ("block", "b"),
        ("node", "cat"), ("node", "pool")]
    assert NetSpec.from_json(spec.to_json()) == spec and spec.to_json()["nodes"][4]["inputs"] == ["a_bn", "stem_relu"]
    assert "sum = add (a_bn, stem_relu)" in spec.describe()


def test_a_graph_whose_conv_takes_a_relu_and_a_pool_runs_them_in_its_block():
    """conv -> ReLU -> max pool, then two branches: the block fuses the ReLU and the pool, and no
    step reads the fused ReLU's output on its own (a step that did read the conv's bare output,
    which no step makes, and the graph could not be built)."""
    from hetconv.engine.graph import GraphPass
    spec = NetSpec.from_json({"input_shape": [3, 8, 8], "classes": 2, "nodes": [
        _node("stem", ["input"], type="conv", out_channels=4, kernel=3, padding=1),
        _node("r", ["stem"], type="relu"), _node("p", ["r"], type="maxpool", kernel=2),
        _node("a", ["p"], type="conv", out_channels=4, kernel=1), _node("b", ["p"], type="conv", out_channels=4, kernel=1),
        _node("sum", ["a", "b"], type="add"), _node("flatten", ["sum"], type="flatten"),
        _node("fc", ["flatten"], type="linear", out_features=2)]})
    stem = spec.conv_layers()[0]
    assert (stem.block.activation, stem.block.pool, stem.node, stem.members) == ("relu", "max", 2, (0, 1, 2))
    assert [(st.kind, spec.names[st.output], st.inputs) for st in spec.graph_steps()] == [
        ("block", "p", (-1,)), ("block", "a", (2,)), ("block", "b", (2,)), ("node", "sum", (3, 4))]
    assert GraphPass(spec, None).requires[2] and spec.norm_nodes() == []


def _with(change):
    data = json.loads(json.dumps(RESIDUAL))
    change(data["nodes"])
    return data


@pytest.mark.parametrize("change, message", [
    (lambda n: n[4].update(inputs=["a_bn", "nowhere"]), "node 4 (sum): inputs ['a_bn', 'nowhere']: expected a list of "
                                                        "earlier nodes' names"),
    (lambda n: n[4].update(inputs=["a_bn", "out"]), "node 4 (sum): inputs ['a_bn', 'out']: expected a list of earlier"),
    (lambda n: n[2].update(stride=2), "layer 4 (add): adds inputs of different shapes: a_bn 4x4x4, stem_relu 4x8x8"),
    (lambda n: n[7].update(inputs=["b", "stem"]) or n[6].update(stride=2),
     "layer 7 (concat): joins maps of different heights and widths: b 2x4x4, stem 4x8x8"),
    (lambda n: n[5].update(type="dropout2d"), "layer 5 (dropout2d): reads sum, which is not a conv block's output"),
    (lambda n: n[4].update(inputs=["a_bn"]), "layer 4 (add): add takes two or more inputs, got 1"),
    (lambda n: n[1].update(name="input"), "node 1: name 'input': expected 1 to 200 letters"),
    (lambda n: n[6].update(name="a"), "node 6: two nodes are named 'a'"),
    (lambda n: n.insert(6, _node("spare", ["out"], type="relu")), "layer 6 (relu): its output is used by no node"),
    (lambda n: n.insert(10, _node("drop", ["flatten"], type="dropout")),
     "layer 11 (linear): after flatten the layers form a chain"),
], ids=["unknown input", "later input", "sum of shapes", "concatenation of sizes", "channel dropout after a sum",
        "sum of one", "reserved name", "two names", "unused node", "head not a chain"])
def test_a_graph_that_cannot_run_is_refused_naming_the_node(change, message):
    with pytest.raises(ValueError) as e:
        NetSpec.from_json(_with(change))
    assert message in str(e.value), str(e.value)


def test_a_stored_network_is_either_a_chain_or_a_graph():
    with pytest.raises(ValueError, match="layers for a chain, or nodes for a graph, not both"):
        NetSpec.from_json({**RESIDUAL, "layers": []})
    chain = NetSpec.from_json(PAPER_JSON)
    assert chain.is_chain() and "layers" in chain.to_json()


@pytest.mark.parametrize("name,params,keys,feature", [("resnet34", 21_797_672, 218, 512),
                                                      ("resnet50", 25_557_032, 320, 2048)])
def test_imagenet_resnets_have_torchvisions_parameters_and_state_dict_keys(name, params, keys, feature):
    """torchvision's resnet34 and resnet50 at 224x224 with 1000 classes: their published parameter
    counts and state_dict lengths, the 7x7 stride-2 stem and max-pool (224 -> 56), and its key names."""
    from hetconv.net.torch_import import state_dict
    spec = preset(name, (3, 224, 224), 1000)
    sd = state_dict(spec, *spec.init_params(np.random.default_rng(0)))
    assert len(sd) == keys and spec.feature_shape() == (feature, 1, 1)
    assert sum(v.size for k, v in sd.items() if k.endswith(("weight", "bias"))) == params
    assert sd["conv1.weight"].shape == (64, 3, 7, 7) and sd["fc.weight"].shape == (1000, feature)
    assert spec.output_shapes()[spec.names.index("maxpool")] == (64, 56, 56)
    # a bottleneck's first block projects even in layer1 (64 -> 256); a basic block's only from layer2
    first = "layer1.0" if name == "resnet50" else "layer2.0"
    last = "layer4.2.bn3" if name == "resnet50" else "layer4.2.bn2"
    assert {f"{first}.downsample.0.weight", f"{first}.downsample.1.running_var", f"{last}.num_batches_tracked"} <= set(sd)
    assert ("layer1.0.downsample.0.weight" in sd) == (name == "resnet50")


# ---- groups and dilation ----------------------------------------------------------------------------

def test_groups_and_dilation_survive_json_and_shape_the_weights():
    from hetconv.geometry import ConvSpec
    from hetconv.engine.costmodel import weight_floats
    spec = NetSpec.from_json(small([{"type": "conv", "out_channels": 8, "kernel": 3, "padding": 1},
                                    {"type": "conv", "out_channels": 8, "kernel": 3, "groups": 8},   # depthwise
                                    {"type": "conv", "out_channels": 4, "kernel": 3, "dilation": 2, "groups": 2},
                                    FLAT, OUT]))
    again = NetSpec.from_json(spec.dumps())
    assert again == spec
    stored = spec.to_json()["layers"]
    assert "groups" not in stored[0] and "dilation" not in stored[0]     # a dense conv's form is as it was
    assert stored[1]["groups"] == 8 and stored[2]["dilation"] == [2, 2]
    assert [s for s in spec.output_shapes()[:3]] == [(8, 16, 16), (8, 14, 14), (4, 10, 10)]
    assert [w for w, _ in spec.parameter_shapes()[0]] == [(8, 3, 3, 3), (8, 1, 3, 3), (4, 4, 3, 3)]
    blocks = spec.conv_layers()
    assert blocks[1].block.groups == 8 and blocks[2].block.dilation == (2, 2) and blocks[2].block.groups == 2
    specs = [ConvSpec.from_layer(b) for b in blocks]
    assert ConvSpec.from_json(specs[2].to_json()) == specs[2]
    assert specs[1].state_layout()[0].shape == (8, 1, 3, 3)
    # a depthwise conv is priced as the 1/C of a dense one it is
    assert weight_floats(specs[1]) == 8 * 9 + 8
    w, _ = spec.init_params(np.random.default_rng(0))[0][1]
    assert np.abs(w).max() <= 1 / 3                                        # fan_in = 1 * 3 * 3


def test_an_older_block_without_groups_or_dilation_means_one():
    d = ConvBlock(stride=2).to_json()
    assert "groups" not in d and "dilation" not in d
    b = ConvBlock.from_json(d)
    assert b.groups == 1 and b.dilation == (1, 1) and b.dense


@pytest.mark.parametrize("conv, what", [
    ({"groups": 3}, "groups 3 must divide out_channels 4"),
    ({"groups": 0}, "groups must be an integer >= 1, got 0"),
    ({"dilation": 0}, "dilation must be an integer >= 1, got 0"),
    ({"dilation": 9}, "dilation 9) does not fit its 16x16 input"),
])
def test_a_bad_group_or_dilation_is_refused_naming_the_value(conv, what):
    with pytest.raises(ValueError, match=r"layer 0 \(conv\).*" + re.escape(what)):
        NetSpec.from_json(small([{**CONV, **conv}, FLAT, OUT]))


def test_groups_must_divide_the_input_channels():
    with pytest.raises(ValueError, match=r"layer 0 \(conv\): groups 2 must divide its 3 input channels"):
        NetSpec.from_json(small([{**CONV, "groups": 2}, FLAT, OUT]))
    from hetconv.geometry import ConvSpec
    with pytest.raises(ValueError, match=r"conv groups 2 must divide both the input channels \(3\)"):
        ConvSpec(3, 4, 3, 3, ConvBlock(groups=2))
