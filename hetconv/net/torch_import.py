"""PyTorch in and out: an nn.Sequential becomes a NetSpec and its weights, and back.

torch is imported here only, and only when one of these functions runs: hetconv trains without it.
The weights cross as float32 numpy copies, conv (K, C, kh, kw) and linear (out, in), as PyTorch
keeps them; to_torch's module has the layer indices as its state_dict keys ("0.weight").
"""
import importlib.util
import os
import sys

import numpy as np

from hetconv.net.spec import Conv, Dropout, Flatten, LayerError, Linear, NetSpec, Pool, ReLU

TORCH_INSTALL = "pip install 'hetconv[torch]' (in a checkout: pip install -e '.[torch]')"
SUPPORTED = ("Conv2d (groups 1, dilation 1, padding_mode 'zeros'), ReLU, MaxPool2d (dilation 1, ceil_mode "
             "False), AvgPool2d (ceil_mode False, count_include_pad True, no divisor_override), Flatten "
             "(start_dim 1), Linear, Dropout, and nested Sequential")


def import_torch():
    """torch, or an ImportError that says which extra provides it."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"PyTorch is not installed; hetconv's PyTorch support needs it: {TORCH_INSTALL}") from None
    return torch


def _flat_modules(seq, prefix=""):
    """(index path, module) for every leaf of a Sequential, nested Sequentials opened in place."""
    nn = import_torch().nn
    out = []
    for name, module in seq.named_children():
        path = f"{prefix}{name}"
        if _is_plain_sequential(module):
            out += _flat_modules(module, path + ".")
        else:
            out.append((path, module))
    return out


def _is_plain_sequential(module):
    """An nn.Sequential, or a subclass that keeps its forward (one that changes it is not a list)."""
    nn = import_torch().nn
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _unsupported(path, module, why):
    return ValueError(f"module {path} ({type(module).__name__}): {why}; supported: {SUPPORTED}")


def _same_padding(path, module):
    """padding='same' as symmetric padding, which exists for odd kernels only (stride 1)."""
    if any(k % 2 == 0 for k in module.kernel_size):
        raise _unsupported(path, module, f"padding 'same' with the even kernel {tuple(module.kernel_size)} "
                                         f"pads unevenly; give the padding as numbers")
    return tuple((k - 1) // 2 for k in module.kernel_size)


def _layer_of(path, module):
    """The hetconv layer equal to one PyTorch module, and its (w, b) if it has parameters."""
    nn = import_torch().nn
    kind = type(module)              # exact: a subclass may compute something else in forward
    if kind is nn.Conv2d:
        if module.groups != 1:
            raise _unsupported(path, module, f"groups {module.groups}")
        if tuple(module.dilation) != (1, 1):
            raise _unsupported(path, module, f"dilation {tuple(module.dilation)}")
        if module.padding_mode != "zeros":
            raise _unsupported(path, module, f"padding_mode {module.padding_mode!r}")
        padding = module.padding
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            padding = _same_padding(path, module)
        layer = Conv(module.out_channels, tuple(module.kernel_size), tuple(module.stride), tuple(padding),
                     module.bias is not None)
        return layer, (_numpy(module.weight), _numpy(module.bias))
    if kind is nn.Linear:
        return Linear(module.out_features, module.bias is not None), (_numpy(module.weight), _numpy(module.bias))
    if kind is nn.ReLU:
        return ReLU(), None
    if kind is nn.MaxPool2d:
        if module.dilation not in (1, (1, 1)):
            raise _unsupported(path, module, f"dilation {module.dilation}")
        if module.ceil_mode:
            raise _unsupported(path, module, "ceil_mode True")
        if module.return_indices:
            raise _unsupported(path, module, "return_indices True")
        return Pool("max", module.kernel_size, module.stride, module.padding), None
    if kind is nn.AvgPool2d:
        if module.ceil_mode:
            raise _unsupported(path, module, "ceil_mode True")
        if not module.count_include_pad:
            raise _unsupported(path, module, "count_include_pad False")
        if module.divisor_override is not None:
            raise _unsupported(path, module, f"divisor_override {module.divisor_override}")
        return Pool("avg", module.kernel_size, module.stride, module.padding), None
    if kind is nn.Flatten:
        if module.start_dim != 1 or module.end_dim != -1:
            raise _unsupported(path, module, f"start_dim {module.start_dim}, end_dim {module.end_dim}")
        return Flatten(), None
    if kind is nn.Dropout:
        return Dropout(module.p), None
    raise _unsupported(path, module, "not supported")


def _numpy(param):
    if param is None:
        return None
    return param.detach().to("cpu").numpy().astype(np.float32, copy=True)


def from_torch(module, input_shape):
    """(NetSpec, conv [(w, b)], fc [(w, b)]) from an nn.Sequential whose current weights are the
    starting weights; the class count is the last Linear's out_features."""
    if not _is_plain_sequential(module):
        raise ValueError(f"expected an nn.Sequential (a network is an ordered list of layers), got "
                         f"{type(module).__name__}; supported layers: {SUPPORTED}")
    modules = _flat_modules(module)
    layers, conv_params, fc_params = [], [], []
    for path, m in modules:
        try:
            layer, params = _layer_of(path, m)
        except ValueError as e:
            if str(e).startswith(f"module {path} "):
                raise
            raise ValueError(f"module {path} ({type(m).__name__}): {e}") from None
        layers.append(layer)
        if params is not None:
            (conv_params if isinstance(layer, Conv) else fc_params).append(params)
    last = next((layer for layer in reversed(layers) if isinstance(layer, Linear)), None)
    if last is None:
        raise ValueError(f"the module has no Linear layer, so no class count; expected conv blocks, Flatten, "
                         f"then Linear layers ({SUPPORTED})")
    try:
        spec = NetSpec(input_shape, last.out_features, tuple(layers))
    except LayerError as e:
        path, m = modules[e.index]
        raise ValueError(f"module {path} ({type(m).__name__}): {e.problem}") from None
    # the module fixes every input width; the spec infers them from input_shape: they must agree
    by_index = dict(enumerate(modules))
    for conv in spec.conv_layers():
        path, m = by_index[conv.index]
        if m.in_channels != conv.in_channels:
            raise ValueError(f"module {path} (Conv2d): in_channels {m.in_channels}, but its input has "
                             f"{conv.in_channels} channels (input_shape {tuple(spec.input_shape)})")
    for op in spec.head():
        if op.type == "linear":
            path, m = by_index[op.index]
            if m.in_features != op.in_features:
                raise ValueError(f"module {path} (Linear): in_features {m.in_features}, but its input has "
                                 f"{op.in_features} features on input_shape {tuple(spec.input_shape)}")
    return spec, conv_params, fc_params


def to_torch(spec, conv_params, fc_params):
    """An nn.Sequential equal to `spec` holding these weights (copied), one module per layer."""
    torch = import_torch()
    nn = torch.nn
    conv_shapes, fc_shapes = spec.parameter_shapes()
    _check_params("conv", conv_params, conv_shapes)
    _check_params("fc", fc_params, fc_shapes)
    conv_iter, fc_iter = iter(conv_params), iter(fc_params)
    in_channels = spec.input_shape[0]
    modules = []
    for layer, op_in in zip(spec.layers, _layer_inputs(spec)):
        if isinstance(layer, Conv):
            m = nn.Conv2d(in_channels, layer.out_channels, layer.kernel, layer.stride, layer.padding,
                          bias=layer.bias)
            _load(torch, m, next(conv_iter))
            in_channels = layer.out_channels
        elif isinstance(layer, Linear):
            m = nn.Linear(op_in, layer.out_features, bias=layer.bias)
            _load(torch, m, next(fc_iter))
        elif isinstance(layer, ReLU):
            m = nn.ReLU()
        elif isinstance(layer, Pool):
            make = nn.MaxPool2d if layer.mode == "max" else nn.AvgPool2d
            m = make(layer.kernel, layer.stride, layer.padding)
        elif isinstance(layer, Flatten):
            m = nn.Flatten()
        else:
            m = nn.Dropout(layer.p)
        modules.append(m)
    return nn.Sequential(*modules)


def _layer_inputs(spec):
    """Each layer's input feature count after flatten (None before it)."""
    shapes = [tuple(spec.input_shape)] + spec.output_shapes()[:-1]
    return [s[0] if len(s) == 1 else None for s in shapes]


def _check_params(part, params, shapes):
    if len(params) != len(shapes):
        raise ValueError(f"{part} params: {len(params)} layers given, the network has {len(shapes)}")
    for i, ((w, b), (w_shape, b_shape)) in enumerate(zip(params, shapes)):
        if tuple(np.shape(w)) != w_shape:
            raise ValueError(f"{part} params {i}: weight shape {tuple(np.shape(w))} != {w_shape}")
        if (b is None) != (b_shape is None) or (b is not None and tuple(np.shape(b)) != b_shape):
            given = None if b is None else tuple(np.shape(b))
            raise ValueError(f"{part} params {i}: bias shape {given} != {b_shape}")


def _load(torch, module, params):
    w, b = params
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(np.array(w, dtype=np.float32)))
        if b is not None:
            module.bias.copy_(torch.from_numpy(np.array(b, dtype=np.float32)))


def load_module(text):
    """The nn.Module that `path.py:function` builds: the file is imported by path and the
    function called with no arguments. This runs the file's code, as `python path.py` would."""
    nn = import_torch().nn
    path, sep, func_name = text.rpartition(":")
    if not sep or not path.endswith(".py") or not func_name.isidentifier():
        raise ValueError(f"--net {text!r}: expected path.py:function, e.g. mynet.py:build")
    if not os.path.isfile(path):
        raise ValueError(f"--net {text}: no such file {path!r}")
    name = f"hetconv_user_net_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    user = importlib.util.module_from_spec(spec)
    sys.modules[name] = user            # dataclasses and pickling in the file look themselves up here
    try:
        spec.loader.exec_module(user)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ValueError(f"--net {text}: importing {path} raised {type(e).__name__}: {e}") from e
    build = getattr(user, func_name, None)
    if not callable(build):
        raise ValueError(f"--net {text}: {path} defines no function {func_name!r}")
    try:
        module = build()
    except Exception as e:
        raise ValueError(f"--net {text}: {func_name}() raised {type(e).__name__}: {e}") from e
    if not isinstance(module, nn.Module):
        raise ValueError(f"--net {text}: {func_name}() returned {type(module).__name__}, expected an "
                         f"nn.Module (an nn.Sequential)")
    return module
