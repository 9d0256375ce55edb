"""A CPU device's options as a run gives them, assembled in one place: the keywords a CPU device
opens with in this process (--local, the coordinator's cores-together calibration, hetconv-plan,
a worker's own device, the model's evaluation) and the hetconv-worker flags that give a spawned
worker the same.
"""
from dataclasses import dataclass

from hetconv.devices.wisdom import machine_wisdom


@dataclass(frozen=True)
class CpuOptions:
    """--cpu-conv-path, --precision, --retime and --deterministic of a CPU device, and whether it
    keeps this machine's wisdom."""
    conv_path: str = "auto"         # a conv path forced on every call, or auto: timed per call shape
    precision: str = "fp32"         # what its conv GEMMs compute in: fp32, bf16 or auto
    retime: bool = False            # time its conv paths again, over what this machine's wisdom kept
    deterministic: bool = False     # conv paths by a fixed rule, never by timing: the same bits every run
    use_wisdom: bool = False        # reuse and keep the paths timed on this machine (devices.wisdom);
                                    # a command's devices do, one made in a test or tool touches no file

    @classmethod
    def of(cls, flags):
        """The options of a command's flags: a training.config.Config or hetconv-worker's
        arguments (both name them alike, read by name: devices import neither), with this
        machine's wisdom."""
        return cls(flags.cpu_conv_path, flags.precision, bool(flags.retime), bool(flags.deterministic), True)

    def device_options(self, threads=None):
        """open_device("cpu", ...)'s keywords: these options and `threads` (0 or None: every core
        this process may use, or under `deterministic` the rule's count)."""
        return {"threads": threads or None, "conv_path": self.conv_path, "precision": self.precision,
                "wisdom": machine_wisdom() if self.use_wisdom else None, "retime": self.retime,
                "deterministic": self.deterministic}

    def worker_flags(self):
        """The hetconv-worker flags that give a spawned worker's CPU device these options (a worker
        keeps its own machine's wisdom)."""
        return (["--cpu-conv-path", self.conv_path, "--precision", self.precision]
                + (["--retime"] if self.retime else []) + (["--deterministic"] if self.deterministic else []))
