"""Train a small network with two local CPU workers from Python, then compare with one device.

    python examples/train_two_cpus.py

The same as `hetconv-coordinator --spawn cpu,cpu --conv 16,32 --fc 64 --steps 100 ...`, for
people who drive training from their own scripts.
"""
from hetconv.train.config import Config
from hetconv.coordinator.remote import RemoteEngine
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.train.loop import train

cfg = Config(conv="16,32", fc="64", batch_size=32, steps=100, synthetic_train=10000, synthetic_test=1000,
             threads=1, calibration_batch=8).validate()

# Two worker processes on this host, pinned to different cores; ended when the engine closes.
engine = RemoteEngine("tcp://127.0.0.1:0", expected_workers=0, spawn=["cpu", "cpu"], threads=1)
try:
    distributed = train(cfg, engine)
finally:
    engine.close()

# The single-device baseline: the same shard code, in this process.
local = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}))

print(f"final loss: distributed {distributed['final_loss']:.5f}, local {local['final_loss']:.5f}")
print(f"median step: distributed {distributed['median_step_s'] * 1e3:.1f} ms, local {local['median_step_s'] * 1e3:.1f} ms")
