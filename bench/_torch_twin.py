"""The PyTorch twin of a hetconv run, for bench/accuracy.py and bench/airbench.py: hetconv's own
starting weights for a seed (so the twin made by hetconv.net.torch_import.to_torch starts where
hetconv starts), and torch.optim.SGD with hetconv's parameter groups. And for every bench's
single-process PyTorch rows: both memory layouts (NCHW, channels_last), and the faster of them as
the row a comparison takes (LAYOUTS, faster_layout). Imports no torch itself: the tables render
from saved JSON alone."""


def initial_weights(cfg, spec):
    """The weights `hetconv-coordinator --seed S` starts `spec` (a NetSpec) from: the conv layers'
    states (hetconv.net.head.init_conv_params, BatchNorms at PyTorch's defaults), then the head's
    linears from the same generator, in the order the training loop draws them. Returns (conv
    states, [(w, b)] per linear)."""
    import numpy as np
    from hetconv.geometry import ConvSpec
    from hetconv.net.head import init_conv_params
    from hetconv.net.layers import Linear
    rng = np.random.default_rng(cfg.seed)
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    conv = init_conv_params(specs, rng)
    fc, width = [], int(np.prod(spec.feature_shape()))
    for op in spec.head():
        if op.type == "linear":
            layer = Linear.init(width, op.layer.out_features, rng)
            fc.append((layer.w, layer.b))
            width = op.layer.out_features
    return conv, fc


def copied(conv, fc):
    """A copy of (conv states, fc) that a run may own and update in place."""
    return [{k: v.copy() for k, v in state.items()} for state in conv], [(w.copy(), b.copy()) for w, b in fc]


def sgd(torch, module, cfg):
    """torch.optim.SGD over `module` as hetconv's default parameter groups (--no-decay bias) update
    it: weight decay on every weight (BatchNorm's scale included), none on any bias."""
    if tuple(g for g in cfg.no_decay.split(",") if g) != ("bias",) or cfg.optimizer != "sgd":
        raise ValueError(f"the PyTorch twin knows --optimizer sgd --no-decay bias, got --optimizer {cfg.optimizer} "
                         f"--no-decay {cfg.no_decay!r}")
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if name.endswith("bias") else decay).append(p)
    return torch.optim.SGD([{"params": decay, "weight_decay": cfg.weight_decay},
                            {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov)


# ---- PyTorch as a user tunes it on a CPU: the faster memory layout -------------------------------
# PyTorch's CPU guidance runs convolution networks, float32 and bf16 autocast alike, on channels-last
# tensors (`model.to(memory_format=torch.channels_last)`, the input
# `.contiguous(memory_format=torch.channels_last)`): oneDNN's blocked kernels then skip reorders.
# So every single-process PyTorch baseline row is measured in both layouts, named
# "<mode> (<layout>)" ("torch bf16 autocast (channels_last)"), and a comparison takes the mode's
# faster layout (faster_layout). Rows of results saved before carry no layout in their names: they
# ran NCHW, and stand for their mode alone.
LAYOUTS = ("NCHW", "channels_last")


def layout_config(mode, layout):
    """The name of `mode`'s row in `layout`: layout_config("torch fp32", "NCHW") == "torch fp32 (NCHW)"."""
    if layout not in LAYOUTS:
        raise ValueError(f"a PyTorch layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    return f"{mode} ({layout})"


def layout_of(config):
    """(mode, layout) of a row's name; (config, None) for a name without a layout."""
    for layout in LAYOUTS:
        if config.endswith(f" ({layout})"):
            return config[:-len(layout) - 3], layout
    return config, None


def in_layout(torch, layout, module=None, tensors=()):
    """(module, tensors) in `layout`: as given for NCHW; for channels_last, the module's 4-d
    parameters and every 4-d tensor in channels-last memory (the values are the same)."""
    if layout not in LAYOUTS:
        raise ValueError(f"a PyTorch layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "NCHW":
        return module, tuple(tensors)
    fmt = torch.channels_last
    module = module.to(memory_format=fmt) if module is not None else None
    return module, tuple(t.contiguous(memory_format=fmt) if t.dim() == 4 else t for t in tensors)


def faster_layout(medians, mode):
    """The row `mode` is compared by: of its rows in each layout (`medians`: {row name: its
    median seconds}), the one with the least; a saved result's row without a layout where that is
    what there is. None where `mode` has no row."""
    mine = {c: s for c, s in medians.items() if s is not None and (c == mode or layout_of(c)[0] == mode
                                                                    and layout_of(c)[1] is not None)}
    return min(mine, key=mine.get) if mine else None


def layout_note(medians, mode, unit=1.0, fmt="{:.3f}", suffix=" s"):
    """'torch fp32: channels_last the faster (0.031 s; NCHW 0.035 s)', or '' where `mode` was not
    measured in both layouts. `unit` scales the seconds (1e3: ms), with `suffix`."""
    both = {layout_of(c)[1]: s for c, s in medians.items()
            if s is not None and layout_of(c)[0] == mode and layout_of(c)[1] is not None}
    if len(both) < 2:
        return ""
    fast = min(both, key=both.get)
    slow = next(layout for layout in both if layout != fast)
    return (f"{mode}: {fast} the faster ({fmt.format(both[fast] * unit)}{suffix}; {slow} "
            f"{fmt.format(both[slow] * unit)}{suffix})")
