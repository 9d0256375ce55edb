"""The coordinator's side of the worker pool: spawning, admitting and watching workers, the remote
step (remote.py), and starting workers on a Ray cluster (ray.py)."""
