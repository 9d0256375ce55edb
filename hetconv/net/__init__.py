"""The network as data: layer specs (spec.py), named networks and `--net` loading (presets.py),
PyTorch import/export (torch_import.py, which alone imports torch, and only when called), the FC
head the coordinator runs (head.py, layers.py), and the slow numpy reference every device is checked
against (reference.py)."""
from hetconv.net.presets import DEFAULT_NET, PRESETS, LoadedNet, load_net, preset
from hetconv.net.spec import (Conv, ConvBlock, ConvLayer, Dropout, Flatten, HeadOp, LayerError, Linear, NetSpec, Pool,
                              ReLU)

__all__ = ["DEFAULT_NET", "PRESETS", "LoadedNet", "load_net", "preset", "ConvBlock", "ConvLayer", "HeadOp",
           "LayerError", "NetSpec", "Conv", "ReLU", "Pool", "Flatten", "Linear", "Dropout"]
