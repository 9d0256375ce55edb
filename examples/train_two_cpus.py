"""Train a small network with two local CPU workers from Python, then compare with one device.

    python examples/train_two_cpus.py

The same as `hetconv-coordinator --spawn cpu,cpu --conv 16,32 --fc 64 --steps 100 ...`, then with
--local, for people who drive training from their own scripts.
"""
import hetconv

small = dict(conv=[16, 32], fc=[64], batch_size=32, steps=100, synthetic_train=10000, synthetic_test=1000,
             threads=1, calibration_batch=8)

# Two worker processes on this host, pinned to different cores; both have ended when train returns.
distributed = hetconv.train(workers=["cpu", "cpu"], **small)

# The single-device baseline: the same shard code, in this process.
local = hetconv.train(local=True, **small)

print(f"final loss: distributed {distributed.final_loss:.5f}, local {local.final_loss:.5f}")
print(f"median step: distributed {distributed.median_step_s * 1e3:.1f} ms, "
      f"local {local.median_step_s * 1e3:.1f} ms")
