"""PyTorch in and out: an nn.Sequential becomes a NetSpec with its weights and back, and a module
hetconv cannot run is refused naming it."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
nn = torch.nn

from hetconv.net import PRESETS, load_net, preset  # noqa: E402
from hetconv.net.torch_import import from_torch, load_module, to_torch  # noqa: E402

WIDTH = {"paper": 0.02, "lenet5": 1.0, "cifar10-quick": 0.25, "vgg-small": 0.125, "vgg-small-bn": 0.125,
         "airbench94": 0.125, "resnet9": 0.0625, "resnet18": 0.0625, "preact-resnet18": 0.0625, "inception-small": 0.25,
         "resnet34": 0.0625, "resnet50": 0.0625, "mobilenet_v2": 0.25, "resnext29": 0.25}


def same_params(a, b):
    return len(a) == len(b) and all(
        np.array_equal(w1, w2) and ((b1 is None and b2 is None) or np.array_equal(b1, b2))
        for (w1, b1), (w2, b2) in zip(a, b))


def conv_weights(states, spec):
    """[(w, b or None)] of from_torch's conv states, b None where the layer has none."""
    return [(s["w"], s["b"] if layer.bias else None) for s, layer in zip(states, spec.conv_layers())]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("input_shape", [(3, 32, 32), (1, 28, 28)])
def test_round_trip_keeps_spec_and_weights(name, input_shape):
    spec = preset(name, input_shape, 10, width=WIDTH[name])
    conv, fc = spec.init_params(np.random.default_rng(1))
    module = to_torch(spec, conv, fc)
    again, states, fc2 = from_torch(module, input_shape)
    assert again == spec
    conv2 = conv_weights(states, spec)
    assert same_params(conv, conv2) and same_params(fc, fc2)
    assert all(w.dtype == np.float32 for w, _ in conv2 + fc2)
    for state, layer in zip(states, spec.conv_layers()):     # BatchNorm's state at PyTorch's start
        for t, op in enumerate(layer.tail):
            if op.type == "batchnorm":
                assert state[f"bn{t}.running_var"].tolist() == [1.0] * layer.kernels
                assert state[f"bn{t}.num_batches_tracked"] == 0 and state[f"bn{t}.num_batches_tracked"].shape == ()


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("input_shape", [(3, 32, 32), (1, 28, 28)])
def test_spec_shapes_equal_what_torch_computes(name, input_shape):
    spec = preset(name, input_shape, 10, width=WIDTH[name])
    module = to_torch(spec, *spec.init_params(np.random.default_rng(0))).eval()
    seen = {}
    for name in spec.names:               # every node is a module at its name, a sum or a concatenation too
        module.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, tuple(out.shape[1:])))
    with torch.no_grad():
        module(torch.zeros((2,) + input_shape))
    seen = [seen[name] for name in spec.names]
    assert seen == spec.output_shapes()
    convs = spec.conv_layers()
    assert [seen[c.index] for c in convs] == [c.conv_shape for c in convs]


def test_to_torch_names_state_by_layer_index_and_computes_with_the_given_weights():
    spec = preset("lenet5", (1, 28, 28), 10)
    conv, fc = spec.init_params(np.random.default_rng(2))
    module = to_torch(spec, conv, fc)
    state = module.state_dict()
    assert list(state) == ["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight", "9.bias",
                           "11.weight", "11.bias"]
    assert np.array_equal(state["3.weight"].numpy(), conv[1][0]) and np.array_equal(state["11.bias"].numpy(), fc[2][1])
    conv[0][0][...] = 0                           # to_torch copied: the module does not share the arrays
    assert state["0.weight"].abs().sum() > 0


def test_from_torch_flattens_nested_sequentials_and_reads_every_padding_form():
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Conv2d(4, 5, (3, 1), stride=(2, 1), padding=(1, 0), bias=False),
                      nn.AvgPool2d(2, stride=1, padding=1)),
        nn.Conv2d(5, 6, 2, padding="valid"),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(6 * 8 * 16, 7).double(),        # 16x16 -> 16x16 -> 8x16 -> 9x17 -> 8x16
    )
    spec, conv, fc = from_torch(module, (3, 16, 16))
    assert [layer.type for layer in spec.layers] == ["conv", "relu", "conv", "avgpool", "conv", "flatten", "dropout",
                                                     "linear"]
    assert spec.layers[0].padding == (1, 1) and spec.layers[2].stride == (2, 1) and spec.layers[2].bias is False
    assert spec.classes == 7 and spec.layers[6].p == 0.25
    assert not spec.conv_layers()[1].bias and not conv[1]["b"].any() and conv[2]["w"].shape == (6, 5, 2, 2)
    assert fc[0][0].dtype == np.float32
    np.testing.assert_array_equal(fc[0][0], module[5].weight.detach().float().numpy())
    with torch.no_grad():
        assert tuple(module.float()(torch.zeros(1, 3, 16, 16)).shape) == (1, 7)


UNSUPPORTED = [
    ("batchnorm without running statistics",
     nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU()),
                   nn.Flatten(), nn.Linear(4 * 14 * 14, 10)), "module 1.0 (BatchNorm2d): track_running_stats False"),
    ("batchnorm of other channels", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5), nn.Flatten(),
                                                  nn.Linear(4 * 14 * 14, 10)),
     "module 1 (BatchNorm2d): num_features 5, but its input has 4 channels"),
    ("adaptive pool to 2x2", nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                           nn.Linear(16, 10)), "module 1 (AdaptiveAvgPool2d): output_size 2"),
    ("reflect padding", nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Flatten(),
                                      nn.Linear(4 * 16 * 16, 10)), "module 0 (Conv2d): padding_mode 'reflect'"),
    ("even same padding", nn.Sequential(nn.Conv2d(3, 4, 2, padding="same"), nn.Flatten(), nn.Linear(4 * 16 * 16, 10)),
     "module 0 (Conv2d): padding 'same' with the even kernel"),
    ("ceil-mode max-pool", nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(),
                                         nn.Linear(4 * 7 * 7, 10)), "module 1 (MaxPool2d): ceil_mode True"),
    ("average without padded zeros", nn.Sequential(nn.Conv2d(3, 4, 3), nn.AvgPool2d(3, padding=1,
                                                                                    count_include_pad=False),
                                                   nn.Flatten(), nn.Linear(4 * 5 * 5, 10)),
     "module 1 (AvgPool2d): count_include_pad False"),
    ("flatten from dim 0", nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(0), nn.Linear(4 * 14 * 14, 10)),
     "module 1 (Flatten): start_dim 0"),
    ("relu right after flatten", nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.ReLU(),
                                               nn.Linear(4 * 14 * 14, 10)),
     "module 2 (ReLU): relu in the FC part must follow a linear"),
    ("channels that do not match the input", nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(),
                                                           nn.Linear(4 * 14 * 14, 10)),
     "module 0 (Conv2d): in_channels 1, but its input has 3 channels"),
    ("features that do not match the input", nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(100, 10)),
     "module 2 (Linear): in_features 100, but its input has 784 features"),
]


@pytest.mark.parametrize("module, what", [case[1:] for case in UNSUPPORTED], ids=[case[0] for case in UNSUPPORTED])
def test_from_torch_names_the_module_it_cannot_take(module, what):
    with pytest.raises(ValueError) as e:
        from_torch(module, (3, 16, 16))
    assert str(e.value).startswith(what), str(e.value)


def test_unsupported_layers_list_what_is_supported():
    with pytest.raises(ValueError, match=r"supported: Conv2d .*BatchNorm2d .*GELU.*Dropout2d.*Linear, Dropout"):
        from_torch(nn.Sequential(nn.Conv2d(3, 4, 3), nn.LocalResponseNorm(2), nn.Flatten(), nn.Linear(784, 10)),
                   (3, 16, 16))


def test_a_module_that_cannot_be_traced_is_refused_saying_so():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            if x.sum() > 0:                         # control flow on a tensor's value: not traceable
                x = -x
            return self.conv(x)

    with pytest.raises(ValueError, match=r"expected an nn.Sequential, or a module whose forward torch.fx can trace; "
                                         r"Net does not trace \(TraceError"):
        from_torch(Net(), (3, 16, 16))


NET_FILE = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Conv2d(1, 3, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 12 * 12, 10))

def not_a_module():
    return [1, 2]

def broken():
    raise RuntimeError("no weights here")

NUMBER = 3
"""


def test_load_net_takes_a_function_in_a_python_file_with_its_weights(tmp_path):
    path = tmp_path / "mynet.py"
    path.write_text(NET_FILE)
    loaded = load_net(f"{path}:build", (1, 28, 28), 10)
    assert [layer.type for layer in loaded.spec.layers] == ["conv", "relu", "maxpool", "flatten", "linear"]
    conv, fc = loaded.params
    assert conv[0]["w"].shape == (3, 1, 5, 5) and fc[0][0].shape == (10, 432)
    with pytest.raises(ValueError, match=r"mynet\.py:build: the network's last Linear has 10 outputs, but the data "
                                         r"set has 100 classes"):
        load_net(f"{path}:build", (1, 28, 28), 100)


@pytest.mark.parametrize("suffix, what", [
    (":not_a_module", "not_a_module() returned list, expected an nn.Module"),
    (":broken", "broken() raised RuntimeError: no weights here"),
    (":missing", "defines no function 'missing'"),
    (":NUMBER", "defines no function 'NUMBER'"),
])
def test_load_module_says_what_is_wrong_with_the_file(tmp_path, suffix, what):
    path = tmp_path / "mynet.py"
    path.write_text(NET_FILE)
    with pytest.raises(ValueError) as e:
        load_module(f"{path}{suffix}")
    assert f"--net {path}{suffix}: " in str(e.value) and what in str(e.value), str(e.value)


def test_load_module_refuses_a_missing_file_and_one_that_fails_to_import(tmp_path):
    with pytest.raises(ValueError, match=r"no such file"):
        load_module(f"{tmp_path / 'nothere.py'}:build")
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"bad\.py:build: importing .*bad\.py raised ModuleNotFoundError"):
        load_module(f"{bad}:build")


# ---- any nn.Module whose forward is a chain, by tracing ---------------------------------------------

TRACED = """
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):                      # the PyTorch tutorial's CNN, with a BatchNorm and a scaled output,
    def __init__(self):                    # a depthwise conv (MobileNet's), a grouped one and a dilated one
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)     # one module called twice: it holds no weights
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.conv2 = nn.Conv2d(6, 16, 5, bias=False, groups=2)
        self.bn = nn.BatchNorm2d(16)
        self.dilated = nn.Conv2d(16, 16, 3, padding=2, dilation=2)
        self.fc1 = nn.Linear(16 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = F.relu(self.depthwise(x))
        x = self.pool(F.gelu(self.bn(self.conv2(x)), approximate="tanh"))
        x = self.dilated(x)
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        return self.fc2(x) / 2


def build():
    torch.manual_seed(4)
    return Net()
"""


def test_a_module_whose_forward_is_a_chain_traces_into_a_network_and_trains_as_torch_sgd_does(tmp_path):
    from hetconv.data import batches, load_dataset
    from hetconv.devices import open_device
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.planner import fixed_plan
    from hetconv.engine.shard import ConvShard
    from hetconv.net.torch_import import state_dict
    from hetconv.training import checkpoint
    from hetconv.training.config import Config
    from hetconv.training.loop import train
    (tmp_path / "tutorial.py").write_text(TRACED)
    target = f"{tmp_path / 'tutorial.py'}:build"
    spec = load_net(target, (3, 32, 32), 10).spec
    assert [layer.type for layer in spec.layers] == ["conv", "relu", "maxpool", "conv", "relu", "conv", "batchnorm",
                                                     "gelu", "maxpool", "conv", "flatten", "linear", "relu", "linear",
                                                     "scale"]
    assert [(c.groups, c.dilation) for c in spec.layers if c.type == "conv"] == [(1, (1, 1)), (6, (1, 1)), (2, (1, 1)),
                                                                                 (1, (2, 2))]
    cfg = Config(net=target, batch_size=16, synthetic_train=160, synthetic_test=32, steps=4, lr=0.05, momentum=0.9,
                 weight_decay=0.0, threads=1, rebalance_after=0, eval_batches=1,
                 checkpoint_dir=str(tmp_path / "ck")).validate()
    losses = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=lambda *_: None)["losses"]
    module = load_module(target)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=160, n_test=32)
    theirs = []
    for step, (x, y) in enumerate(batches(ds, 16, np.random.default_rng([cfg.seed, 0]))):
        if step == 4:
            break
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(losses, theirs, rtol=1e-4)
    # the kernels split between two shards: the grouped conv's at a group boundary (5 of its 16
    # kernels asked, a group of 8 held), the depthwise conv's anywhere; the same steps
    split = LocalEngine({w: ConvShard(open_device("cpu", threads=1)) for w in ("s0", "s1")})
    split.fixed_plan = fixed_plan([6, 6, 16, 16], {"s0": [2, 1, 5, 7], "s1": [4, 5, 11, 9]})
    split_losses = train(Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "split")}), split,
                         log=lambda *_: None)["losses"]
    assert [split.plan.layers[i].ranges["s0"] for i in range(4)] == [(0, 2), (0, 1), (0, 8), (0, 7)]
    np.testing.assert_allclose(split_losses, theirs, rtol=1e-4)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    ours = state_dict(spec, conv, [(layer["w"], layer["b"]) for layer in fc])
    assert sorted(ours) == sorted(module.state_dict())      # the module's own names
    for key, want in module.state_dict().items():
        np.testing.assert_allclose(ours[key], want.numpy(), rtol=1e-4, atol=1e-5, err_msg=key)
    # exported back, the convs keep their groups and dilation, and compute what the module does
    exported = to_torch(spec, conv, [(layer["w"], layer["b"]) for layer in fc]).eval()
    assert [(m.groups, m.dilation) for m in exported.modules() if isinstance(m, nn.Conv2d)] == \
        [(1, (1, 1)), (6, (1, 1)), (2, (1, 1)), (1, (2, 2))]
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32))
    with torch.no_grad():
        np.testing.assert_allclose(exported(x).numpy(), module.eval()(x).numpy(), rtol=1e-4, atol=1e-5)


class _AddConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x) + 1.0, 1))


class _CatHeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 2, 1), nn.Conv2d(3, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 32 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.cat([self.a(x), self.b(x)], dim=2), 1))


class _DropoutAfterSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.drop = nn.Dropout2d(0.1)
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.drop(self.conv(x) + x), 1))


class _SumOfShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x) + x, 1))


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(self.conv(x)), 1))


class _Softmin(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.nn.functional.softmin(self.conv(x), dim=1), 1))


@pytest.mark.parametrize("module, what", [
    (_AddConstant(), "x + y in `return self.fc(torch.flatten(self.conv(x) + 1.0, 1))` at {file}:{line}: adds a "
                     "constant to a tensor"),
    (_CatHeight(), "torch.cat(...) in `return self.fc(torch.flatten(torch.cat([self.a(x), self.b(x)], dim=2), 1))` at "
                   "{file}:{line}: concatenates along dim 2; expected dim=1"),
    (_DropoutAfterSum(), "module drop (Dropout2d) in `return self.fc(torch.flatten(self.drop(self.conv(x) + x), 1))` "
                         "at {file}:{line}: reads add, which is not a conv block's output"),
    (_SumOfShapes(), "x + y in `return self.fc(torch.flatten(self.conv(x) + x, 1))` at {file}:{line}: adds inputs of "
                     "different shapes: conv 2x16x16, input 3x16x16"),
    (_Shared(), "self.conv(...) (Conv2d) in `return self.fc(torch.flatten(self.conv(self.conv(x)), 1))` at "
                "{file}:{line}: module conv is called twice with the same weights"),
    (_Softmin(), "F.softmin(...) in `return self.fc(torch.flatten(torch.nn.functional.softmin(self.conv(x), dim=1), "
                 "1))` at {file}:{line}: not supported; supported: Conv2d"),
], ids=["constant sum", "concatenation of heights", "channel dropout after a sum", "sum of shapes", "shared weights",
        "unsupported function"])
def test_a_traced_module_with_an_op_hetconv_cannot_run_is_refused_naming_the_users_line(module, what):
    import inspect
    with pytest.raises(ValueError) as e:
        from_torch(module, (3, 16, 16))
    line = inspect.getsourcelines(type(module).forward)[1] + 1
    assert str(e.value).startswith(what.format(file=__file__, line=line)), str(e.value)


class _ScaledSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.add(self.conv(x), x, alpha=2), 1))


def test_a_sum_with_alpha_is_refused_naming_the_node():
    with pytest.raises(ValueError, match=r"torch.add\(...\) in `return self.fc\(torch.flatten\(torch.add\("
                                         r"self.conv\(x\), x, alpha=2\), 1\)\)` at .*test_net_torch.py:\d+: "
                                         r"a sum with alpha; expected a \+ b"):
        from_torch(_ScaledSum(), (3, 16, 16))


def test_an_export_refuses_a_node_named_inside_another_layer():
    from hetconv.net.spec import Conv, Flatten, Linear, NetSpec
    spec = NetSpec((3, 8, 8), 10, (Conv(2, 3, padding=1), Conv(2, 3, padding=1), Flatten(), Linear(10)),
                   names=("a", "a.b", "flatten", "fc"))
    with pytest.raises(ValueError, match="node a.b: a is a layer of its own, so a.b cannot sit inside it"):
        to_torch(spec, *spec.init_params(np.random.default_rng(0)))


def test_the_hard_activations_import_and_export_as_their_own_modules():
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU6(), nn.Hardtanh(-2.0, 0.5), nn.Hardsigmoid(), nn.Flatten(),
                           nn.Linear(4 * 14 * 14, 10))
    spec, conv, fc = from_torch(module, (3, 16, 16))
    assert [layer.to_json() for layer in spec.layers[1:4]] == [
        {"type": "relu6"}, {"type": "hardtanh", "min_val": -2.0, "max_val": 0.5}, {"type": "hardsigmoid"}]
    back = to_torch(spec, conv, fc)
    assert [type(m) for m in back[1:4]] == [nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid]
    assert (back[2].min_val, back[2].max_val) == (-2.0, 0.5)
    x = torch.randn(2, 3, 16, 16) * 4
    with torch.no_grad():
        torch.testing.assert_close(back(x), module(x))


class _TorchFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 14 * 14, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.sigmoid(torch.tanh(self.conv(x))), 1))


def test_torch_tanh_and_sigmoid_import_though_their_signatures_match_numbers_too():
    """torch.tanh(x) matches its tensor signature and its int, float and complex ones alike, which
    torch.fx's argument matching refuses as ambiguous: given the tensor alone, it is the activation."""
    spec, conv, fc = from_torch(_TorchFunctions(), (3, 16, 16))
    assert [layer.to_json() for layer in spec.layers[1:3]] == [{"type": "tanh"}, {"type": "sigmoid"}]


class _Head(nn.Module):
    """A conv, then the global pool and flatten written as `ending` (x is the conv's output)."""

    def __init__(self, ending):
        super().__init__()
        self.conv, self.fc, self.ending = nn.Conv2d(3, 4, 3), nn.Linear(4, 10), ending

    def forward(self, x):
        return self.fc(self.ending(self.conv(x)))


POOL_AND_FLATTEN = {
    "mean": lambda x: x.mean((2, 3)),
    "mean dim negative": lambda x: x.mean(dim=(-2, -1)),
    "torch.mean keepdim flatten": lambda x: torch.mean(x, (2, 3), keepdim=True).flatten(1),
    "mean reshape shape": lambda x: x.mean([2, 3], True).reshape(x.shape[0], -1),
    "mean reshape size": lambda x: x.mean((2, 3), keepdim=True).reshape(x.size(0), -1),
    "squeeze": lambda x: x.mean((2, 3), keepdim=True).squeeze(),
    "squeeze twice": lambda x: x.mean((-2, -1), keepdim=True).squeeze(-1).squeeze(-1),
    "torch.flatten of a pool": lambda x: torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1),
    "flat already": lambda x: torch.mean(x, (2, 3)).reshape(x.size(0), -1),
}


@pytest.mark.parametrize("ending", POOL_AND_FLATTEN.values(), ids=POOL_AND_FLATTEN.keys())
def test_a_mean_over_height_and_width_is_a_global_average_pool_and_flattens_written_any_way(ending):
    module = _Head(ending)
    spec, conv, fc = from_torch(module, (3, 8, 8))
    assert [layer.type for layer in spec.layers] == ["conv", "global_avgpool", "flatten", "linear"]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(to_torch(spec, conv, fc)(x), module(x))


# a class as a notebook cell or generated code makes it: fx keeps no source line for its forward
EXEC_DEFINED = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))
"""


def test_a_module_whose_class_was_defined_by_exec_imports_and_computes_as_torch_does():
    namespace = {"nn": nn, "F": nn.functional}
    exec(EXEC_DEFINED, namespace)
    module = namespace["Net"]()
    spec, conv, fc = from_torch(module, (3, 8, 8))
    assert [layer.type for layer in spec.layers] == ["conv", "relu", "global_avgpool", "flatten", "linear"]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(to_torch(spec, conv, fc)(x), module(x))


def test_a_refusal_in_a_class_defined_by_exec_names_the_op_without_a_line():
    namespace = {"nn": nn, "F": nn.functional}
    exec(EXEC_DEFINED.replace(".mean((2, 3))", ".mean((1, 3))"), namespace)
    with pytest.raises(ValueError, match=r"^x\.mean\(\.\.\.\): a mean over dim \(1, 3\)"):
        from_torch(namespace["Net"](), (3, 8, 8))


@pytest.mark.parametrize("ending, what", [
    (lambda x: x.mean((1, 3)), "a mean over dim (1, 3); expected the mean over height and width"),
    (lambda x: x.squeeze(), "squeezes a 4 x 6 x 6 tensor; expected C x 1 x 1 (after a global pool), or a flatten: "
                            "x.flatten(1)"),
    (lambda x: x.mean((2, 3), True).squeeze(-1), "leaves N x C x 1, which self.fc(...) (Linear) in `return self.fc("),
    (lambda x: x.mean((2, 3), True).squeeze(1), "squeezes dim 1; expected the spatial ones"),
    (lambda x: x.mean((2, 3), True).view(x.size(1), -1), "a view to a shape other than (batch, -1)"),
    (lambda x: x.mean((2, 3), True).relu6(), "x.relu6(...) in "),
], ids=["mean over channels", "squeeze of a map", "one squeeze", "squeeze of channels", "view by channels",
        "a method torch has not"])
def test_an_idiom_hetconv_cannot_take_is_refused_showing_the_users_line(ending, what):
    with pytest.raises(Exception) as e:
        from_torch(_Head(ending), (3, 8, 8))
    message = str(e.value)
    assert what in message and "test_net_torch.py:" in message, message
    assert "getattr" not in message and "squeeze_1" not in message, message


HARD = """
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):                      # MobileNet's habits: clipped activations, a mean for the pool
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.act = nn.ReLU6()
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.clip = nn.Hardtanh(-0.5, 0.55)
        self.gate = nn.Hardsigmoid()
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.max_pool2d(self.act(self.conv1(x)), 2)
        x = F.hardsigmoid(F.hardtanh(F.relu6(self.conv2(x)), 0.1, 0.4))
        x = self.gate(self.clip(x))
        x = x.mean((2, 3), keepdim=True)
        return self.fc(x.reshape(x.shape[0], -1))


def build():
    torch.manual_seed(5)
    return Net()
"""


def test_a_module_with_the_hard_activations_and_a_mean_pool_trains_as_torch_sgd_does(tmp_path):
    from _module_runs import assert_equals_torch, local_module_run
    cfg, losses, (_, conv, fc) = local_module_run(tmp_path, HARD)
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    assert [layer.type for layer in spec.layers] == [
        "conv", "relu6", "maxpool", "conv", "relu6", "hardtanh", "hardsigmoid", "hardtanh", "hardsigmoid",
        "global_avgpool", "flatten", "linear"]
    assert_equals_torch(cfg, losses, conv, fc)


from _module_runs import build_with_batchnorm_away_from_one  # noqa: E402

# MobileNetV2's inverted residual as torchvision writes it (module names included), small: a 1x1
# expansion, a depthwise 3x3 and a 1x1 projection, each with a BatchNorm, ReLU6 after the first
# two, and `x + self.conv(x)` with no activation after the sum; F.adaptive_avg_pool2d(x, (1, 1)),
# then Dropout before the Linear.
INVERTED = """
import torch
from torch import nn
import torch.nn.functional as F


class InvertedResidual(nn.Module):          # torchvision's MobileNetV2 block: expand, depthwise, project
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        self.use_res_connect = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)),
            nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                          nn.ReLU6(inplace=True)),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout))

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)          # no activation after the sum
        return self.conv(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU6(inplace=True)),
            InvertedResidual(4, 4, 1, 2),
            InvertedResidual(4, 6, 2, 2),
            InvertedResidual(6, 6, 1, 2),
            nn.Sequential(nn.Conv2d(6, 12, 1, bias=False), nn.BatchNorm2d(12), nn.ReLU6(inplace=True)))
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(12, 10))

    def forward(self, x):
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))

""" + build_with_batchnorm_away_from_one("Net", 6)


def test_an_inverted_residual_module_trains_as_torch_sgd_does_and_on_two_shards(tmp_path):
    """--local against PyTorch, then two in-process shards on a fixed plan, every block's kernels
    split unevenly (the depthwise convs' anywhere): the same losses and state as --local. (Data
    blocks need the peer exchange between worker processes: tests/test_graph_training.py.)"""
    from _module_runs import assert_equal_runs, assert_equals_torch, local_module_run, quiet
    from hetconv.devices import open_device
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.planner import fixed_plan
    from hetconv.engine.shard import ConvShard
    from hetconv.training import checkpoint
    from hetconv.training.config import Config
    from hetconv.training.loop import train
    cfg, losses, local = local_module_run(tmp_path, INVERTED)
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    assert [layer.type for layer in spec.layers].count("add") == 2
    assert [c.groups for c in spec.layers if c.type == "conv"] == [1, 1, 8, 1, 1, 8, 1, 1, 12, 1, 1]
    _, conv, fc = local
    assert_equals_torch(cfg, losses, conv, fc)
    kernels = [c.kernels for c in spec.conv_layers()]
    engine = LocalEngine({w: ConvShard(open_device("cpu", threads=1)) for w in ("s0", "s1")})
    engine.fixed_plan = fixed_plan(kernels, {"s0": [k // 3 for k in kernels], "s1": [k - k // 3 for k in kernels]})
    split = train(Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "split")}), engine, log=quiet)["losses"]
    np.testing.assert_allclose(split, losses, rtol=1e-5)
    assert_equal_runs(checkpoint.load(str(tmp_path / "split")), local)


# ---- mobilenet_v2 and resnext29 against PyTorch modules written here --------------------------------
class _MobileNetV2(nn.Module):
    """torchvision's MobileNetV2 (module names, _make_divisible widths, Conv-BN-ReLU6 triples), with
    the CIFAR strides: stem and the 24-channel stage at stride 1."""

    def __init__(self, width, classes):
        super().__init__()

        def divisible(v):
            rounded = max(8, int(v + 4) // 8 * 8)
            return rounded + 8 if rounded < 0.9 * v else rounded

        def cbr(cin, cout, kernel, stride=1, groups=1):
            return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU6())

        cin = divisible(32 * width)
        features = [cbr(3, cin, 3)]
        for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                           (6, 160, 3, 2), (6, 320, 1, 1)):
            for b in range(n):
                block, out, hidden = nn.Module(), divisible(c * width), cin * t
                block.residual = (s if b == 0 else 1) == 1 and cin == out
                block.conv = nn.Sequential(*([cbr(cin, hidden, 1)] if t != 1 else []),
                                           cbr(hidden, hidden, 3, s if b == 0 else 1, hidden),
                                           nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out))
                features.append(block)
                cin = out
        features.append(cbr(cin, divisible(1280 * max(1.0, width)), 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(divisible(1280 * max(1.0, width)), classes))

    def forward(self, x):
        for f in self.features:
            x = x + f.conv(x) if getattr(f, "residual", False) else (f.conv(x) if hasattr(f, "conv") else f(x))
        return self.classifier(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class _ResNeXtBlock(nn.Module):
    def __init__(self, cin, group_width, stride):
        super().__init__()
        out = 2 * group_width
        self.conv1, self.bn1 = nn.Conv2d(cin, group_width, 1, bias=False), nn.BatchNorm2d(group_width)
        self.conv2 = nn.Conv2d(group_width, group_width, 3, stride, 1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(group_width)
        self.conv3, self.bn3 = nn.Conv2d(group_width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn3(self.conv3(torch.relu(self.bn2(self.conv2(h)))))
        return torch.relu(h + (x if self.downsample is None else self.downsample(x)))


class _ResNeXt29(nn.Module):
    """ResNeXt-29 8x4d for CIFAR at `width` (stem 64, groups' widths 32, 64, 128, outputs twice those)."""

    def __init__(self, width, classes):
        super().__init__()
        cin = max(1, int(round(64 * width)))
        self.conv1, self.bn1 = nn.Conv2d(3, cin, 3, 1, 1, bias=False), nn.BatchNorm2d(cin)
        for stage in range(3):
            group_width = 8 * max(1, int(round(4 * width))) * 2 ** stage
            blocks = []
            for b in range(3):
                blocks.append(_ResNeXtBlock(cin, group_width, 2 if stage > 0 and b == 0 else 1))
                cin = 2 * group_width
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("name, reference, width, params", [
    ("mobilenet_v2", _MobileNetV2, 1.0, 2_236_682), ("mobilenet_v2", _MobileNetV2, 0.25, 250_922),
    ("resnext29", _ResNeXt29, 1.0, 361_674), ("resnext29", _ResNeXt29, 0.25, None)])
def test_the_cifar_mobilenet_and_resnext_presets_are_the_torch_modules_key_for_key(name, reference, width, params):
    """Their state_dict keys, shapes and parameter counts are those of the module written above, and
    that module given their weights computes their logits (evaluation mode: strides, groups, sums)."""
    from hetconv.net.torch_import import state_dict
    spec = preset(name, (3, 32, 32), 10, width)
    conv, fc = spec.init_params(np.random.default_rng(4))
    ours = state_dict(spec, conv, fc)
    torch.manual_seed(0)
    module = reference(width, 10).eval()
    theirs = module.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == tuple(v.shape) for k, v in theirs.items())
    count = sum(p.numel() for p in module.parameters())
    assert sum(v.size for k, v in ours.items() if k.endswith(("weight", "bias"))) == count
    assert params is None or count == params
    module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in ours.items()})
    exported = to_torch(spec, conv, fc).eval()
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32))
    with torch.no_grad():
        np.testing.assert_allclose(exported(x).numpy(), module(x).numpy(), rtol=1e-4, atol=1e-5)
    if name == "mobilenet_v2":          # the CIFAR strides: 32x32 reaches the last stage at 4x4
        assert spec.output_shapes()[spec.names.index("features.18.2")][1:] == (4, 4)


def test_mobilenet_v2_has_torchvisions_parameters():
    """Only where torchvision imports (it is no dependency): the same count as its mobilenet_v2 at
    each width, whose strides (which the CIFAR preset changes) hold no parameters."""
    try:
        import torchvision.models
    except Exception as e:          # noqa: BLE001  (absent, or a wheel built for another torch)
        pytest.skip(f"torchvision (not a dependency of hetconv) does not import here: {type(e).__name__}: {e}")
    from hetconv.net.torch_import import state_dict
    for width in (1.0, 0.5):
        spec = preset("mobilenet_v2", (3, 32, 32), 10, width)
        ours = state_dict(spec, *spec.init_params(np.random.default_rng(0)))
        theirs = torchvision.models.mobilenet_v2(num_classes=10, width_mult=width).state_dict()
        assert sorted(ours) == sorted(theirs)
        assert all(ours[k].shape == tuple(v.shape) for k, v in theirs.items())


@pytest.mark.parametrize("name, width", [("mobilenet_v2", 0.25), ("resnext29", 0.5)])
def test_the_cifar_mobilenet_and_resnext_presets_train_a_step_locally(tmp_path, name, width):
    """One --local step on 16x16 crops: a finite loss, the depthwise convs by the rule on oneDNN's
    direct path where oneDNN runs them (else the depthwise path), the grouped ones (two channels a group: at a quarter width resnext29's are one, so
    depthwise) on an im2col path."""
    from _module_runs import quiet
    from hetconv.devices import open_device
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.shard import ConvShard
    from hetconv.training.config import Config
    from hetconv.training.loop import train
    cfg = Config(net=f"{name}@{width}", crop=16, batch_size=4, synthetic_train=16, synthetic_test=4, steps=1, lr=0.01,
                 threads=1, rebalance_after=0, eval_batches=1, checkpoint_dir=str(tmp_path / "ck")).validate()
    device = open_device("cpu", threads=1)
    losses = train(cfg, LocalEngine({"local": ConvShard(device)}), log=quiet)["losses"]
    assert len(losses) == 1 and np.isfinite(losses[0])
    grouped = {c["path"] for c in device.conv_path_choices() if (c["key"]["block"] or {}).get("groups", 1) > 1}
    if name == "mobilenet_v2":
        assert grouped == ({"direct-dnnl"} if "direct-dnnl" in device.machine_key()["paths"] else {"depthwise"})
    else:
        assert grouped and all(path.startswith("im2col") for path in grouped), grouped
