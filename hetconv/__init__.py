"""hetconv: train CNNs across mixed CPUs and GPUs by splitting each conv layer's kernels in
proportion to measured device speed; the fully connected layers stay on the coordinator."""
__version__ = "0.1.0"
