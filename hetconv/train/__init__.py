"""The training run: the loop (loop.py), its configuration, checkpoints, and the snapshots that let
it go on when a worker is lost."""
