"""The PyTorch twin of a hetconv run, for bench/accuracy.py and bench/airbench.py: hetconv's own
starting weights for a seed (so the twin made by hetconv.net.torch_import.to_torch starts where
hetconv starts), and torch.optim.SGD with hetconv's parameter groups."""


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
