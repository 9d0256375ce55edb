"""The network as data: layer specs (spec.py), named networks and `--net` loading (presets.py),
and PyTorch import/export (torch_import.py, which alone imports torch, and only when called)."""
from hetconv.net.presets import DEFAULT_NET, PRESETS, LoadedNet, load_net, preset
from hetconv.net.spec import (ConvBlock, ConvLayer, HeadOp, LayerError, NetSpec, Conv, ReLU, Pool, Flatten, Linear,
                              Dropout)

__all__ = ["DEFAULT_NET", "PRESETS", "LoadedNet", "load_net", "preset", "ConvBlock", "ConvLayer", "HeadOp",
           "LayerError", "NetSpec", "Conv", "ReLU", "Pool", "Flatten", "Linear", "Dropout"]
