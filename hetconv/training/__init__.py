"""The training run: the loop (loop.py), its configuration and recipe, checkpoints, and the
snapshots that let it go on when a worker is lost. From Python: hetconv.train (hetconv.api)."""
