"""PyTorch in and out: an nn.Sequential (or a module whose forward torch.fx traces into a chain of
layers) becomes a NetSpec and its weights, and back.

torch is imported here only, and only when one of these functions runs: hetconv trains without it.
The weights cross as float32 numpy copies, conv (K, C, kh, kw) and linear (out, in), as PyTorch
keeps them; to_torch's module has the layer indices as its state_dict keys ("0.weight").
"""
import importlib.util
import operator
import os
import re
import sys
import traceback

import numpy as np

from hetconv.geometry import ConvSpec
from hetconv.net.spec import (INPUT_NAME, Activation, Add, BatchNorm, ChannelLayer, Concat, Conv, Dropout, Dropout2d,
                              Flatten, GlobalPool, LayerError, Linear, NetSpec, Pool, ReLU, Scale)

TORCH_INSTALL = "pip install 'hetconv[torch]' (in a checkout: pip install -e '.[torch]')"
SUPPORTED = ("Conv2d (any groups and dilation, padding_mode 'zeros'), BatchNorm2d (track_running_stats), ReLU, GELU, "
             "SiLU, LeakyReLU, ELU, CELU, Tanh, Sigmoid, Hardswish, ReLU6, Hardtanh, Hardsigmoid, Identity, "
             "MaxPool2d (dilation 1, ceil_mode False), AvgPool2d (ceil_mode False, count_include_pad True, no "
             "divisor_override), AdaptiveAvgPool2d(1), AdaptiveMaxPool2d(1), Dropout2d, Flatten (start_dim 1), Linear, "
             "Dropout, and nested Sequential; in a forward also F.relu and the other activations (and x.relu(), "
             "x.sigmoid(), x.tanh()), F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d(x, 1), "
             "F.adaptive_max_pool2d(x, 1), x.mean((2, 3)) (keepdim or not: a global average pool), F.dropout, "
             "F.dropout2d, x.flatten(1), torch.flatten(x, 1), x.view(x.size(0), -1), x.reshape(x.shape[0], -1), "
             "x.view(-1, features), x.squeeze() of an N x C x 1 x 1 tensor, x * c and x / c (c a number), a + b "
             "(a residual sum), torch.cat([a, b], dim=1)")

# PyTorch's activation modules without parameters of their own -> hetconv's kind
_PLAIN_ACTIVATIONS = {"SiLU": "silu", "Tanh": "tanh", "Sigmoid": "sigmoid", "Hardswish": "hardswish",
                      "ReLU6": "relu6", "Hardsigmoid": "hardsigmoid", "Identity": "identity"}


def import_torch():
    """torch, or an ImportError that says which extra provides it."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"PyTorch is not installed; hetconv's PyTorch support needs it: {TORCH_INSTALL}") from None
    return torch


def _flat_modules(seq, prefix=""):
    """(index path, module) for every leaf of a Sequential, nested Sequentials opened in place."""
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
    """padding='same' as symmetric padding, which exists where the dilated kernel's span is odd
    (stride 1)."""
    spans = [d * (k - 1) for k, d in zip(module.kernel_size, module.dilation)]
    if any(s % 2 for s in spans):
        raise _unsupported(path, module, f"padding 'same' with the even kernel {tuple(module.kernel_size)} "
                                         f"(dilation {tuple(module.dilation)}) pads unevenly; give the padding as numbers")
    return tuple(s // 2 for s in spans)


def _layer_of(path, module):
    """The hetconv layer equal to one PyTorch module, and its (w, b) if it has parameters."""
    nn = import_torch().nn
    kind = type(module)              # exact: a subclass may compute something else in forward
    if kind is nn.Conv2d:
        if module.padding_mode != "zeros":
            raise _unsupported(path, module, f"padding_mode {module.padding_mode!r}")
        padding = module.padding
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            padding = _same_padding(path, module)
        layer = Conv(module.out_channels, tuple(module.kernel_size), tuple(module.stride), tuple(padding),
                     module.bias is not None, tuple(module.dilation), module.groups)
        return layer, (_numpy(module.weight), _numpy(module.bias))
    if kind is nn.Linear:
        return Linear(module.out_features, module.bias is not None), (_numpy(module.weight), _numpy(module.bias))
    if kind is nn.ReLU:
        return ReLU(), None
    if kind.__name__ in _PLAIN_ACTIVATIONS and kind is getattr(nn, kind.__name__):
        return Activation(_PLAIN_ACTIVATIONS[kind.__name__]), None
    if kind is nn.GELU:
        return Activation("gelu", approximate=module.approximate), None
    if kind is nn.LeakyReLU:
        return Activation("leaky_relu", negative_slope=float(module.negative_slope)), None
    if kind is nn.Hardtanh:
        return Activation("hardtanh", min_val=float(module.min_val), max_val=float(module.max_val)), None
    if kind in (nn.ELU, nn.CELU):
        return Activation(kind.__name__.lower(), alpha=float(module.alpha)), None
    if kind is nn.BatchNorm2d:
        if not module.track_running_stats:
            raise _unsupported(path, module, "track_running_stats False (evaluation would use the batch's statistics)")
        return BatchNorm(float(module.eps), None if module.momentum is None else float(module.momentum),
                         bool(module.affine)), _batchnorm_state(module)
    if kind in (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d):
        if module.output_size not in (1, (1, 1)):
            raise _unsupported(path, module, f"output_size {module.output_size} (only 1: a global pool)")
        if kind is nn.AdaptiveMaxPool2d and module.return_indices:
            raise _unsupported(path, module, "return_indices True")
        return GlobalPool("avg" if kind is nn.AdaptiveAvgPool2d else "max"), None
    if kind is nn.Dropout2d:
        return Dropout2d(module.p), None
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
    if kind is scale_module_class():
        return Scale(module.factor), None
    raise _unsupported(path, module, "not supported")


def _batchnorm_state(module):
    """A BatchNorm2d's parameters and buffers by their state_dict names (weight and bias only
    where affine)."""
    state = {"running_mean": _numpy(module.running_mean), "running_var": _numpy(module.running_var),
             "num_batches_tracked": module.num_batches_tracked.detach().to("cpu").numpy().astype(np.int64)}
    if module.affine:
        state.update(weight=_numpy(module.weight), bias=_numpy(module.bias))
    return state


def _numpy(param):
    if param is None:
        return None
    return param.detach().to("cpu").numpy().astype(np.float32, copy=True)


def from_torch(module, input_shape):
    """(NetSpec, conv [state], fc [(w, b)]) from a PyTorch module whose current weights and
    buffers are the start: an nn.Sequential, or any nn.Module whose forward torch.fx traces into a
    chain of supported modules and functions (F.relu, torch.flatten, x.view(x.size(0), -1), ...);
    the class count is the last Linear's out_features. A conv layer's state is {name: array} as
    ConvSpec.state_layout names it: its weights and bias, and its tail's BatchNorm weights, biases
    and running statistics; after the conv layers', each BatchNorm between blocks (NetSpec.norm_nodes)
    has its state as NormSpec.state_layout names it."""
    if _is_plain_sequential(module):
        flat = _flat_modules(module)
        steps = [(f"module {path} ({type(m).__name__})", m, None, None, None) for path, m in flat]
        features, squeezes, lines = {}, {}, {}
    else:
        steps, features, squeezes, lines = _traced_steps(module)
    layers, conv_params, fc_params = [], [], []
    for label, m, layer, _, _ in steps:
        if layer is None:
            try:
                layer, params = _layer_of(label.split()[1], m)
            except ValueError as e:
                if str(e).startswith(label.split(" (")[0] + " "):
                    raise
                raise ValueError(f"{label}: {e}") from None
            if isinstance(layer, (Conv, Linear)):
                (conv_params if isinstance(layer, Conv) else fc_params).append(params)
        layers.append(layer)
    last = next((layer for layer in reversed(layers) if isinstance(layer, Linear)), None)
    if last is None:
        raise ValueError(f"the module has no Linear layer, so no class count; expected conv blocks, Flatten, "
                         f"then Linear layers ({SUPPORTED})")
    graph = steps and steps[0][3] is not None
    inputs = tuple(step[4] for step in steps) if graph else None
    names = tuple(step[3] for step in steps) if graph else None
    try:
        spec = NetSpec(input_shape, last.out_features, tuple(layers), inputs, names)
    except LayerError as e:
        line = lines.get(e.index, "")
        raise ValueError(f"{steps[e.index][0]}{' ' + line if line else ''}: {e.problem}") from None
    for index, label in squeezes.items():                   # a squeeze flattens only what a global pool left
        source = spec.inputs[index][0]
        shape = spec.input_shape if source < 0 else spec.output_shapes()[source]
        if tuple(shape[1:]) != (1, 1):
            raise ValueError(f"{label}: squeezes a {' x '.join(map(str, shape))} tensor; expected C x 1 x 1 "
                             f"(after a global pool), or a flatten: {_FLATTEN_FORMS}")
    for index, width in features.items():                    # a view(-1, K) must flatten to K features
        if spec.output_shapes()[index] != (width,):
            raise ValueError(f"{steps[index][0]}: views its input as (-1, {width}), but it has "
                             f"{spec.output_shapes()[index][0]} features on input_shape {tuple(spec.input_shape)}")
    # a module step's label is "module PATH (Type)"; a function's is its op, a single word where fx
    # kept no source line (a class defined by exec): it has no module to look up
    modules = [(label.split()[1] if m is not None else label, m) for label, m, _, _, _ in steps]
    # the module fixes every input width; the spec infers them from input_shape: they must agree
    by_index = dict(enumerate(modules))
    states = []
    for conv, (w, b) in zip(spec.conv_layers(), conv_params):
        path, m = by_index[conv.index]
        if m.in_channels != conv.in_channels:
            raise ValueError(f"module {path} (Conv2d): in_channels {m.in_channels}, but its input has "
                             f"{conv.in_channels} channels (input_shape {tuple(spec.input_shape)})")
        state = {"w": w, "b": np.zeros(conv.kernels, np.float32) if b is None else b}
        for t, index in enumerate(conv.layer_indices):
            if conv.tail[t].type == "batchnorm":
                path, m = by_index[index]
                if m.num_features != conv.kernels:
                    raise ValueError(f"module {path} (BatchNorm2d): num_features {m.num_features}, but its input has "
                                     f"{conv.kernels} channels")
                state.update({f"bn{t}.{name}": a for name, a in _batchnorm_state(m).items()})
        states.append(state)
    for index, norm in zip(spec.norm_nodes(), spec.norm_specs()):     # BatchNorms between blocks, after the blocks
        path, m = by_index[index]
        if m.num_features != norm.channels:
            raise ValueError(f"module {path} (BatchNorm2d): num_features {m.num_features}, but its input has "
                             f"{norm.channels} channels")
        states.append(_batchnorm_state(m))
    conv_params = states
    for op in spec.head():
        if op.type == "linear":
            path, m = by_index[op.index]
            if m.in_features != op.in_features:
                raise ValueError(f"module {path} (Linear): in_features {m.in_features}, but its input has "
                                 f"{op.in_features} features on input_shape {tuple(spec.input_shape)}")
    return spec, conv_params, fc_params


# ---- any nn.Module, by tracing ----------------------------------------------------------------------

def _traced_steps(module):
    """([(label, module or None, layer or None, name, inputs)], {step: features}, {step: label}) of
    a module's forward traced by torch.fx, in the trace's order: a module call is (label, the
    module, None, ...), a function or method (label, None, its layer, ...); `inputs` are the steps
    whose outputs it reads (-1: the images). A module's first call is named by its path (a module
    with weights is called once: its path is its state_dict prefix), anything else by its node's
    name. A function's label is the user's own line (fx records it), never fx's node names. An
    nn.Identity, dropout with training=False, and a flatten of what is flat already pass their
    input on; x.mean((2, 3)) is a global average pool (and a flatten without keepdim). A view(-1,
    K) must flatten to K features (the second dict); a squeeze must find C x 1 x 1 (the third); the
    fourth gives a module call's line in the user's forward ("in `...` at file:n"), for refusals."""
    torch = import_torch()
    own = merge_module_classes() + (scale_module_class(),)

    class Tracer(torch.fx.Tracer):
        record_stack_traces = True                      # each node keeps the user's line, for the refusals

        def is_leaf_module(self, m, qualname):          # an exported graph's joins and scales stay one node each
            return type(m) in own or super().is_leaf_module(m, qualname)
    try:
        traced = torch.fx.GraphModule(module, Tracer().trace(module))
    except Exception as e:              # noqa: BLE001 (any failure of the user's forward under tracing)
        raise ValueError(f"expected an nn.Sequential, or a module whose forward torch.fx can trace; "
                         f"{type(module).__name__} does not trace ({type(e).__name__}: {str(e)[:200]})") from None
    named = dict(traced.named_modules())
    steps, features, squeezes, index, alias, called, lines = [], {}, {}, {}, {}, set(), {}
    flat = set()                # steps whose output is (N, features) already
    half_squeezed = {}          # a squeeze of one spatial dim (N x C x 1 left) -> its label: the other must follow

    def resolve(n):
        while n in alias:
            n = alias[n]
        return n

    def add_step(label, m, layer, name, inputs):
        steps.append((label, m, layer, name, inputs))
        if isinstance(layer, Flatten) or (type(m) is torch.nn.Flatten) or (inputs and all(i in flat for i in inputs)):
            flat.add(len(steps) - 1)

    for node in traced.graph.nodes:
        if node.op == "placeholder":
            if index:
                raise ValueError(f"the forward takes more than one input ({node.name} too); expected the images only")
            index[node] = -1
            continue
        if _is_shape_query(node):
            continue                                     # x.size(0), x.shape[0]: an argument of the view that follows
        where = _where(node, named)
        if node.op == "output":
            returned = node.args[0] if node.args else None
            if isinstance(returned, torch.fx.Node) and resolve(returned) in half_squeezed:
                raise ValueError(f"{half_squeezed[resolve(returned)]}: leaves N x C x 1; expected both spatial "
                                 f"dimensions squeezed, e.g. x.squeeze(-1).squeeze(-1) or x.flatten(1)")
            if not isinstance(returned, torch.fx.Node) or index.get(resolve(returned)) != len(steps) - 1:
                raise ValueError(f"the forward returns {getattr(returned, 'name', returned)!r:.80}; "
                                 f"expected one tensor, the last layer's output")
            break
        if node.op == "get_attr":
            raise ValueError(f"{where}: a tensor the forward reads from the module itself; supported: {SUPPORTED}")
        merge, operands = _merge_of(node, where, named)
        if merge is None:
            operands = [n for n in node.all_input_nodes if not _is_shape_query(n)]
            if len(operands) != 1:
                raise ValueError(f"{where} takes {len(operands)} tensors; expected one, or a sum (+, torch.add) or "
                                 f"a torch.cat(dim=1) of several")
        operands = [resolve(n) for n in operands]
        unknown = [n.name for n in operands if n not in index]
        if unknown:
            raise ValueError(f"{where} reads {unknown[0]}, which is not a tensor of the network")
        inputs = tuple(index[n] for n in operands)
        if merge is None and operands[0] in half_squeezed:
            if _squeeze_dims(node) in ((-1,), (2,)):     # the second spatial dimension: now (N, C)
                del half_squeezed[operands[0]]
                alias[node] = operands[0]
                continue
            raise ValueError(f"{half_squeezed[operands[0]]}: leaves N x C x 1, which {where} reads; expected both "
                             f"spatial dimensions squeezed, e.g. x.squeeze(-1).squeeze(-1) or x.flatten(1)")
        if merge is not None:
            add_step(where, None, merge, node.target if node.op == "call_module" else node.name, inputs)
        elif node.op == "call_module":
            m = named[node.target]
            if type(m) is torch.nn.Identity or (type(m) is torch.nn.Flatten and inputs[0] in flat):
                alias[node] = operands[0]
                continue
            owns = any(True for _ in m.parameters()) or any(True for _ in m.buffers())
            if node.target in called and owns:
                raise ValueError(f"{where}: module {node.target} is called twice with the same weights; "
                                 f"a layer's weights are its own")
            name = node.target if node.target not in called else node.name
            called.add(node.target)
            add_step(f"module {node.target} ({type(m).__name__})", m, None, name, inputs)
            if " in `" in where:
                lines[len(steps) - 1] = where[where.index(" in `") + 1:]          # "in `line` at file:n"
        else:
            layer, width = _function_layer(node, where)
            if isinstance(layer, Flatten) and inputs[0] in flat:      # flat already: nothing to do
                if width is not None:
                    features[inputs[0]] = width
                alias[node] = operands[0]
                continue
            if layer is None:
                alias[node] = operands[0]
                continue
            if isinstance(layer, tuple):                 # mean((2, 3)) without keepdim: pool, then flatten
                add_step(where, None, layer[0], node.name, inputs)
                inputs, layer = (len(steps) - 1,), layer[1]
                add_step(where, None, layer, node.name + "_flatten", inputs)
            else:
                add_step(where, None, layer, node.name, inputs)
            if width is not None:
                features[len(steps) - 1] = width
            if _squeeze_dims(node) is not None:
                squeezes[len(steps) - 1] = where
                if len(_squeeze_dims(node)) == 1:
                    half_squeezed[node] = where
        index[node] = len(steps) - 1
    used = set()
    for k, (label, m, layer, name, inputs) in enumerate(steps):
        unique, n = name, 1
        while unique in used:                       # a function's node named as a module's path
            unique, n = f"{name}_{n}", n + 1
        used.add(unique)
        steps[k] = (label, m, layer, unique, inputs)
    return steps, features, squeezes, lines


def _where(node, named):
    """The node as the user wrote it: the op, and the line of the forward that made it (fx's
    stack trace, its innermost frame outside torch), e.g. "x.mean(...) in `x = x.mean(1)` at
    net.py:12"; the op alone where fx recorded no line."""
    torch = import_torch()
    target = node.target
    if node.op == "call_module":
        what = f"self.{target}(...) ({type(named[target]).__name__})"
    elif node.op == "call_method":
        what = f"x.{target}(...)"
    elif node.op == "get_attr":
        what = f"self.{target}"
    elif target in _OPERATORS:
        what = f"x {_OPERATORS[target]} y"
    else:
        name = getattr(target, "__name__", str(target))
        prefix = "F." if getattr(torch.nn.functional, name, None) is target else \
            "torch." if getattr(torch, name, None) is target else ""
        what = f"{prefix}{name}(...)"
    torch_dir = os.path.dirname(torch.__file__)
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n +([^\n]*)', node.stack_trace or "")
    frames = [f for f in frames if not os.path.abspath(f[0]).startswith(torch_dir + os.sep)]
    if not frames:
        return what
    path, line, source = frames[-1]
    return f"{what} in `{source.strip()}` at {path}:{line}"


_OPERATORS = {operator.add: "+", operator.iadd: "+=", operator.mul: "*", operator.imul: "*=", operator.truediv: "/",
              operator.itruediv: "/=", operator.sub: "-", operator.matmul: "@", operator.getitem: "[...]"}


def _merge_of(node, where, named):
    """(Add() or Concat(), the tensors it joins in order) for a sum or a concatenation of tensors
    (an exported graph's Sum and Cat modules too), else (None, None); a merge hetconv cannot run
    (a sum with a constant or a scaled operand, a concatenation along another dimension) is a
    ValueError naming the user's line."""
    torch = import_torch()
    fx = torch.fx
    refuse = lambda why: ValueError(f"{where}: {why}")     # noqa: E731
    target = node.target
    if node.op == "call_module" and type(named[target]) in merge_module_classes():
        if len(node.args) < 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
            raise refuse("a join of fewer than two tensors of the network")
        return (Add() if type(named[target]) is merge_module_classes()[0] else Concat()), list(node.args)
    is_sum = (node.op == "call_function" and target in (operator.add, operator.iadd, torch.add)) or \
        (node.op == "call_method" and target in ("add", "add_"))
    if is_sum:
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
            raise refuse("a sum with alpha; expected a + b")
        operands = list(node.args[:2]) + ([node.kwargs["other"]] if "other" in node.kwargs else [])
        if len(operands) != 2 or not all(isinstance(a, fx.Node) and not _is_shape_query(a) for a in operands):
            raise refuse("adds a constant to a tensor; supported: the sum of two tensors (a residual connection)")
        return Add(), operands
    is_cat = node.op == "call_function" and target in (torch.cat, getattr(torch, "concat", None),
                                                        getattr(torch, "concatenate", None))
    if is_cat:
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", node.kwargs.get("axis", 0))
        if dim not in (1, -3):
            raise refuse(f"concatenates along dim {dim}; expected dim=1 (channels)")
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, fx.Node) for t in tensors):
            raise refuse("concatenates something other than tensors of the network")
        if len(tensors) < 2:
            return None, None                            # a cat of one tensor passes it on
        return Concat(), list(tensors)
    return None, None


def _is_size(node):
    return isinstance(node, _fx_node()) and node.op == "call_method" and node.target == "size"


def _is_shape_query(node):
    """x.size(), x.size(0), x.shape, x.shape[0]: numbers about a tensor, not a tensor."""
    if not isinstance(node, _fx_node()):
        return False
    if _is_size(node):
        return True
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] == "shape"
    return node.op == "call_function" and node.target is operator.getitem and _is_shape_query(node.args[0])


def _is_batch_size(a):
    """A number, x.size(0) or x.shape[0] (x.size()[0]): the batch dimension of a view or reshape."""
    if isinstance(a, int) and not isinstance(a, bool):
        return True
    if _is_size(a):
        return (a.args[1] if len(a.args) > 1 else a.kwargs.get("dim")) == 0
    if _is_shape_query(a) and a.target is operator.getitem and a.args[1] == 0:
        whole = a.args[0]
        return not _is_size(whole) or (len(whole.args) == 1 and not whole.kwargs)
    return False


def _fx_node():
    return import_torch().fx.Node


def _squeeze_dims(node):
    """The dims a squeeze (x.squeeze(...), torch.squeeze(x, ...)) names, () for all of them, or
    None for any other node."""
    torch = import_torch()
    if not ((node.op == "call_method" and node.target == "squeeze") or
            (node.op == "call_function" and node.target is torch.squeeze)):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None:
        return ()
    return tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)


_FUNCTION_ACTIVATIONS = {"relu": "relu", "relu_": "relu", "gelu": "gelu", "silu": "silu", "leaky_relu": "leaky_relu",
                         "elu": "elu", "celu": "celu", "tanh": "tanh", "sigmoid": "sigmoid", "hardswish": "hardswish",
                         "relu6": "relu6", "hardtanh": "hardtanh", "hardtanh_": "hardtanh",
                         "hardsigmoid": "hardsigmoid"}
_FLATTEN_FORMS = ("x.flatten(1), torch.flatten(x, 1), x.view(x.size(0), -1), x.reshape(x.shape[0], -1), "
                  "x.view(-1, features)")


def _function_layer(node, where):
    """(The layer of a traced function or method call, None for one that does nothing here
    (dropout with training=False), or (GlobalPool, Flatten) for a mean over H and W without
    keepdim; the features a view(-1, K) promises, or None), or ValueError naming the user's line."""
    torch = import_torch()
    F = torch.nn.functional
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    args, kwargs = list(node.args[1:]), dict(node.kwargs)
    refuse = lambda why: ValueError(f"{where}: {why}")     # noqa: E731
    if node.op == "call_function" and node.target in (operator.mul, operator.truediv):
        constant = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(constant) != 1:
            raise refuse("a product of two tensors; supported: a tensor times or over a constant (a scale)")
        if constant[0] == 0 and node.target is operator.truediv:
            raise refuse("division by zero")
        return Scale(constant[0] if node.target is operator.mul else 1.0 / constant[0]), None
    if (node.op == "call_method" and name == "mean") or (node.op == "call_function" and node.target is torch.mean):
        return _mean_layer(args, kwargs, refuse), None
    dims = _squeeze_dims(node)
    if dims is not None:
        if dims == () or sorted(d % 4 for d in dims) in ([2], [3], [2, 3]):
            return Flatten(), None
        raise refuse(f"squeezes dim {dims if len(dims) != 1 else dims[0]}; expected the spatial ones of an N x C x 1 "
                     f"x 1 tensor (x.squeeze(), x.squeeze((2, 3)), x.squeeze(-1).squeeze(-1)), or {_FLATTEN_FORMS}")
    if node.op == "call_method":
        if name in ("flatten",):
            start = args[0] if args else kwargs.get("start_dim", 0)
            if start != 1 or (args[1:] or [kwargs.get("end_dim", -1)])[0] != -1:
                raise refuse(f"flatten from dim {start}; expected flatten(1): keep the batch dimension")
            return Flatten(), None
        if name in ("view", "reshape"):
            shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
            if len(shape) == 2 and shape[1] == -1 and _is_batch_size(shape[0]):
                return Flatten(), None
            if len(shape) == 2 and shape[0] == -1 and isinstance(shape[1], int):
                return Flatten(), shape[1]
            raise refuse(f"a {name} to a shape other than (batch, -1) or (-1, features); expected one of "
                         f"{_FLATTEN_FORMS}: flattening before the head")
        if name in _FUNCTION_ACTIVATIONS and hasattr(torch.Tensor, name) and not args and not kwargs:
            kind = _FUNCTION_ACTIVATIONS[name]
            return (ReLU() if kind == "relu" else Activation(kind)), None
        raise refuse(f"not supported; supported: {SUPPORTED}")
    from torch.fx.operator_schemas import normalize_function
    try:
        found = normalize_function(node.target, tuple(node.args), node.kwargs, normalize_to_only_use_kwargs=True)
    except RuntimeError:
        # torch.tanh, torch.sigmoid and the like are overloaded for numbers too, and a tensor
        # matches their signatures ambiguously; given the tensor alone there is nothing to name
        if len(node.args) != 1 or node.kwargs:
            raise refuse("arguments that match more than one of its signatures") from None
        found = None
    kw = dict(found.kwargs) if found else {}
    kw.pop("input", None)
    kw.pop("inplace", None)
    if name in _FUNCTION_ACTIVATIONS:
        kind = _FUNCTION_ACTIVATIONS[name]
        if kind == "relu":
            return ReLU(), None
        params = {"gelu": ("approximate",), "leaky_relu": ("negative_slope",), "elu": ("alpha",),
                  "celu": ("alpha",), "hardtanh": ("min_val", "max_val")}.get(kind, ())
        return Activation(kind, **{k: kw[k] for k in params if k in kw}), None
    if node.target in (F.max_pool2d, F.avg_pool2d):
        mode = "max" if node.target is F.max_pool2d else "avg"
        if kw.get("ceil_mode"):
            raise refuse("ceil_mode True")
        if kw.get("dilation", 1) not in (1, (1, 1)) or kw.get("return_indices"):
            raise refuse("dilation or return_indices")
        if mode == "avg" and (not kw.get("count_include_pad", True) or kw.get("divisor_override") is not None):
            raise refuse("count_include_pad False or a divisor_override")
        return Pool(mode, kw["kernel_size"], kw.get("stride") or None, kw.get("padding", 0)), None
    if node.target in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
        if kw.get("output_size") not in (1, (1, 1), [1, 1]):
            raise refuse(f"output_size {kw.get('output_size')} (only 1: a global pool)")
        return GlobalPool("avg" if node.target is F.adaptive_avg_pool2d else "max"), None
    if node.target is torch.flatten:
        if kw.get("start_dim") != 1 or kw.get("end_dim", -1) != -1:
            raise refuse(f"start_dim {kw.get('start_dim')}; expected torch.flatten(x, 1)")
        return Flatten(), None
    if node.target in (F.dropout, F.dropout2d):
        if not kw.get("training", True):
            return None, None
        return (Dropout if node.target is F.dropout else Dropout2d)(kw.get("p", 0.5)), None
    raise refuse(f"not supported; supported: {SUPPORTED}")


def _mean_layer(args, kwargs, refuse):
    """x.mean((2, 3)) / torch.mean(x, dim=(-2, -1), keepdim=...): a global average pool, and a
    flatten after it without keepdim ((GlobalPool, Flatten))."""
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims) or sorted(d % 4 for d in dims) != [2, 3] \
            or len(dims) != 2:
        raise refuse(f"a mean over dim {dim!r}; expected the mean over height and width of an N x C x H x W tensor: "
                     f"x.mean((2, 3)) or x.mean(dim=(-2, -1)), with or without keepdim (a global average pool)")
    if kwargs.get("dtype") is not None or len(args) > 2:
        raise refuse("a mean with a dtype; expected x.mean((2, 3)) in the tensor's own dtype")
    if not isinstance(keepdim, bool):
        raise refuse(f"keepdim {keepdim!r}; expected True or False")
    return GlobalPool("avg") if keepdim else (GlobalPool("avg"), Flatten())


def state_dict(spec, conv_params, fc_params):
    """The state_dict of `spec` with these weights, as numpy arrays and without torch: keys
    "NAME.weight", "NAME.bias", "NAME.running_mean", "NAME.num_batches_tracked" by the layer's
    name, which is its position ("0.weight", as nn.Sequential names them) unless the network
    names its nodes (a traced module's own paths: "layer1.0.conv1.weight"). conv_params: per conv layer its state
    {name: array}, or (w, b) with its BatchNorms at PyTorch's start, then per BatchNorm between blocks
    (NetSpec.norm_nodes) its state (at PyTorch's start where not given); fc_params: per linear (w, b)."""
    conv_shapes, fc_shapes = spec.parameter_shapes()
    blocks = len(conv_shapes)
    norm_params = list(conv_params[blocks:]) or [norm.initial_state() for norm in spec.norm_specs()]
    conv_params = [p if isinstance(p, dict) else ConvSpec.from_layer(layer).initial_state(*p)   # BatchNorm at its start
                   for p, layer in zip(conv_params[:blocks], spec.conv_layers())]
    _check_params("conv", [(p["w"], p.get("b")) for p in conv_params], conv_shapes, optional_bias=True)
    _check_params("fc", fc_params, fc_shapes, optional_bias=True)
    out = {}
    for layer, state in zip(spec.conv_layers(), conv_params):
        out[f"{spec.names[layer.index]}.weight"] = np.asarray(state["w"], np.float32)
        if layer.bias:
            out[f"{spec.names[layer.index]}.bias"] = np.asarray(state["b"], np.float32)
        for t, index in enumerate(layer.layer_indices):
            if layer.tail[t].type != "batchnorm":
                continue
            names = (("weight", "bias") if layer.tail[t].affine else ()) + ("running_mean", "running_var")
            for name in names + ("num_batches_tracked",):
                key = f"bn{t}.{name}"
                if key not in state:
                    raise ValueError(f"conv layer {layer.index}: no {key} for its BatchNorm (layer {index})")
                out[f"{spec.names[index]}.{name}"] = np.asarray(state[key], np.int64 if name == "num_batches_tracked" else
                                                    np.float32)
    if len(norm_params) != len(spec.norm_nodes()):
        raise ValueError(f"the network has {len(spec.norm_nodes())} BatchNorms between its blocks, {len(norm_params)} "
                         f"states were given after its {blocks} conv layers'")
    for index, norm, state in zip(spec.norm_nodes(), spec.norm_specs(), norm_params):
        for a in norm.state_layout():
            if a.name not in state:
                raise ValueError(f"BatchNorm node {spec.names[index]}: no {a.name} in its state")
            out[f"{spec.names[index]}.{a.name}"] = np.asarray(state[a.name], a.dtype)
    linears = [op for op in spec.head() if op.type == "linear"]
    for op, (w, b) in zip(linears, fc_params):
        out[f"{spec.names[op.index]}.weight"] = np.asarray(w, np.float32)
        if op.layer.bias:
            out[f"{spec.names[op.index]}.bias"] = np.asarray(b, np.float32)
    return out


def to_torch(spec, conv_params, fc_params):
    """A PyTorch module equal to `spec` holding these weights and statistics (copied): for a chain
    with positional names an nn.Sequential, one module per layer (a scale as a module of its own,
    which torch.export and ONNX trace to a multiply); otherwise a graph_module_class() whose
    modules sit at their nodes' names, so its state_dict keys are the network's own."""
    torch = import_torch()
    nn = torch.nn
    weights = state_dict(spec, conv_params, fc_params)
    shapes = spec.output_shapes()
    modules = [_module_of(nn, spec, i, shapes) for i in range(len(spec.layers))]
    if spec.is_chain() and spec.names == tuple(str(i) for i in range(len(spec.layers))):
        module = nn.Sequential(*modules)
    else:
        plan = []
        module = graph_module_class()(plan)
        for i, (name, m) in enumerate(zip(spec.names, modules)):
            plan.append((name, [INPUT_NAME if j < 0 else spec.names[j] for j in spec.inputs[i]]))
            _place(module, name, m)
    module.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()})
    return module


def _module_of(nn, spec, i, shapes):
    """Layer i as a PyTorch module (None for a sum or a concatenation, which are functions)."""
    layer = spec.layers[i]
    source = spec.inputs[i][0]
    in_shape = spec.input_shape if source < 0 else shapes[source]
    if isinstance(layer, Conv):
        return nn.Conv2d(in_shape[0], layer.out_channels, layer.kernel, layer.stride, layer.padding,
                         dilation=layer.dilation, groups=layer.groups, bias=layer.bias)
    if isinstance(layer, Linear):
        return nn.Linear(in_shape[0], layer.out_features, bias=layer.bias)
    if isinstance(layer, ChannelLayer) and len(in_shape) == 3:
        return _channel_module(nn, layer, in_shape[0])
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, Flatten):
        return nn.Flatten()
    if isinstance(layer, Scale):
        return _Scale(layer.factor)
    if isinstance(layer, Dropout):
        return nn.Dropout(layer.p)
    sum_class, cat_class = merge_module_classes()
    return sum_class() if isinstance(layer, Add) else cat_class()


def _place(root, name, module):
    """root's submodule at the dotted `name`, with empty modules for the parts before the last."""
    nn = import_torch().nn
    parts = name.split(".")
    owner = root
    for k, part in enumerate(parts[:-1]):
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        elif type(child) is not nn.Module:
            raise ValueError(f"node {name}: {'.'.join(parts[:k + 1])} is a layer of its own, so {name} cannot sit "
                             f"inside it; rename one of them")
        owner = child
    if parts[-1] in owner._modules or hasattr(owner, parts[-1]):
        raise ValueError(f"node {name}: the name is taken in the exported module (another node, or one of "
                         f"nn.Module's own attributes); rename it")
    owner.add_module(parts[-1], module)


_GRAPH = []          # the graph module class, made once torch is imported
_MERGES = []         # the sum and concatenation module classes, likewise


def merge_module_classes():
    """(Sum, Cat): hetconv's add and concat as modules, so an exported graph keeps every node's
    name, and from_torch reads them back as the same nodes."""
    if not _MERGES:
        torch = import_torch()

        class Sum(torch.nn.Module):
            """The sum of its inputs, left to right (a residual connection)."""

            def forward(self, *xs):
                y = xs[0]
                for x in xs[1:]:
                    y = y + x
                return y

        class Cat(torch.nn.Module):
            """Its inputs side by side along channels (torch.cat(dim=1))."""

            def forward(self, *xs):
                return torch.cat(xs, 1)

        _MERGES.extend([Sum, Cat])
    return tuple(_MERGES)


def graph_module_class():
    """The nn.Module a graph network is in PyTorch: `plan` lists (name, input names) in order,
    each name a submodule (a layer, or a Sum or Cat of merge_module_classes()); forward runs them
    in order on the images (INPUT_NAME) and returns the last. torch.export traces the loop away:
    what it keeps is the graph itself."""
    if not _GRAPH:
        torch = import_torch()

        class NetworkGraph(torch.nn.Module):
            """A hetconv network whose layers read named outputs of the layers before them."""

            def __init__(self, plan):
                super().__init__()
                self.plan = plan

            def forward(self, x):
                values = {INPUT_NAME: x}
                y = x
                for name, inputs in self.plan:
                    y = self.get_submodule(name)(*[values[i] for i in inputs])
                    values[name] = y
                return y

        _GRAPH.append(NetworkGraph)
    return _GRAPH[0]


def _channel_module(nn, layer, channels):
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, Pool):
        return (nn.MaxPool2d if layer.mode == "max" else nn.AvgPool2d)(layer.kernel, layer.stride, layer.padding)
    if isinstance(layer, GlobalPool):
        return (nn.AdaptiveMaxPool2d if layer.mode == "max" else nn.AdaptiveAvgPool2d)(1)
    if isinstance(layer, BatchNorm):
        return nn.BatchNorm2d(channels, layer.eps, layer.momentum, layer.affine)
    if isinstance(layer, Dropout2d):
        return nn.Dropout2d(layer.p)
    kind = layer.kind
    if kind == "gelu":
        return nn.GELU(approximate=layer.approximate)
    if kind == "leaky_relu":
        return nn.LeakyReLU(layer.negative_slope)
    if kind == "hardtanh":
        return nn.Hardtanh(layer.min_val, layer.max_val)
    if kind in ("elu", "celu"):
        return (nn.ELU if kind == "elu" else nn.CELU)(layer.alpha)
    return getattr(nn, {v: k for k, v in _PLAIN_ACTIVATIONS.items()}[kind])()


_SCALE = []          # the Scale module class, made once torch is imported


def scale_module_class():
    """The nn.Module hetconv's `scale` layer is in PyTorch (x * factor): what an export holds, and
    what a user's nn.Sequential may hold for it (airbench's Mul(1/9))."""
    if not _SCALE:
        torch = import_torch()

        class Scale(torch.nn.Module):
            """Multiplies by a constant (hetconv's scale layer)."""

            def __init__(self, factor):
                super().__init__()
                self.factor = float(factor)

            def forward(self, x):
                return x * self.factor

            def extra_repr(self):
                return f"factor={self.factor:g}"

        _SCALE.append(Scale)
    return _SCALE[0]


def _Scale(factor):
    return scale_module_class()(factor)


def _check_params(part, params, shapes, optional_bias=False):
    if len(params) != len(shapes):
        raise ValueError(f"{part} params: {len(params)} layers given, the network has {len(shapes)}")
    for i, ((w, b), (w_shape, b_shape)) in enumerate(zip(params, shapes)):
        if tuple(np.shape(w)) != w_shape:
            raise ValueError(f"{part} params {i}: weight shape {tuple(np.shape(w))} != {w_shape}")
        if optional_bias and b_shape is None:
            continue                                 # a state keeps a zero bias the layer does not have
        if (b is None) != (b_shape is None) or (b is not None and tuple(np.shape(b)) != b_shape):
            given = None if b is None else tuple(np.shape(b))
            raise ValueError(f"{part} params {i}: bias shape {given} != {b_shape}")


# ---- modules given as objects (hetconv.train(net=module)) --------------------------------------------

_GIVEN = {}          # "module:NAME#N" -> the nn.Module, while the run that was given it prepares


def given_module_name(module):
    """A --net text that stands for `module` in this process (until forget_given_module): what
    hetconv.train(net=module) puts in the run's config, as --net FILE.py:FUNCTION would be."""
    name = f"module:{type(module).__name__}#{len(_GIVEN) + 1}"
    while name in _GIVEN:
        name += "+"
    _GIVEN[name] = module
    return name


def forget_given_module(name):
    _GIVEN.pop(name, None)


def given_module(text):
    """The nn.Module a given_module_name stands for; ValueError for a module:... text this
    process was not given (a config saved by another run)."""
    if text not in _GIVEN:
        raise ValueError(f"--net {text}: an nn.Module that hetconv.train(net=...) was given in another process; give "
                         f"the module again, or a path.py:function that builds it")
    return _GIVEN[text]


def _user_frame(error, path):
    """' at FILE:LINE: `source`' for the innermost frame of `error`'s traceback in the file at
    `path` (or the line a SyntaxError names), '' if none."""
    if isinstance(error, SyntaxError) and error.filename and os.path.abspath(error.filename) == os.path.abspath(path):
        return f" at {path}:{error.lineno}" + (f": `{error.text.strip()}`" if error.text else "")
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]
    if not frames:
        return ""
    return f" at {path}:{frames[-1].lineno}" + (f": `{frames[-1].line}`" if frames[-1].line else "")


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
        raise ValueError(f"--net {text}: importing {path} raised {type(e).__name__}: {e}{_user_frame(e, path)} "
                         f"(--verbose shows the traceback)") from e
    build = getattr(user, func_name, None)
    if not callable(build):
        raise ValueError(f"--net {text}: {path} defines no function {func_name!r}")
    try:
        module = build()
    except Exception as e:
        raise ValueError(f"--net {text}: {func_name}() raised {type(e).__name__}: {e}{_user_frame(e, path)} "
                         f"(--verbose shows the traceback)") from e
    if not isinstance(module, nn.Module):
        raise ValueError(f"--net {text}: {func_name}() returned {type(module).__name__}, expected an "
                         f"nn.Module")
    return module
