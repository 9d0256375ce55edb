"""What crosses a socket and how: the message format, wire dtypes, CURVE keys, peer sockets, and the
argv that starts a worker. Below both the coordinator and the worker, which share it."""
