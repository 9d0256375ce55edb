"""Where a worker's peer inbox listens and how a peer reaches it: tcp on the interface that reaches
the coordinator, or ipc:// where a token file proves the peer shares this host and network
namespace."""
import hmac
import os
import secrets
import socket
import stat
import tempfile
import uuid

import zmq

from hetconv.transport.keys import serve_peers, set_message_limit


def host_key():
    """Peers with the same key share a host name and a network stack: ipc:// may reach them, and is
    faster than tcp. A separate network namespace (an emulated host) gets a key of its own. Not
    proof of a shared /tmp (containers can share both and not it): see ipc_reachable."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def route_address(coordinator):
    """The local address this host uses to reach the coordinator's endpoint: by default the one
    peers can reach us on too."""
    if not coordinator.startswith("tcp://"):
        return "127.0.0.1"
    hostport = coordinator[len("tcp://"):]
    host = hostport.rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((host, 9))           # no packet is sent: this only asks the routing table
            return probe.getsockname()[0]
        finally:
            probe.close()
    except OSError:
        return "127.0.0.1"


def bind_inbox(ctx, address, keydir="", log=print, limit=0):
    """A PULL socket other workers push their slices to, on tcp (address) and on ipc. With a key
    folder it is a CURVE server that admits only the plan's workers (see transport.keys.serve_peers;
    what it costs: every feature map is encrypted and authenticated, a few hundred MB/s per core
    with libsodium, against the GB/s a loopback or ipc link moves otherwise). Returns (socket,
    [endpoints] ipc first, authenticator or None, PeerKeys or None)."""
    inbox = ctx.socket(zmq.PULL)
    inbox.linger = 0
    if limit:
        set_message_limit(inbox, limit)         # before bind: the listener copies it
    auth = peer_keys = None
    if keydir:
        auth, peer_keys = serve_peers(ctx, inbox, keydir, log)
    port = inbox.bind_to_random_port(f"tcp://{address}")
    path = os.path.join(tempfile.gettempdir(), f"hetconv-{os.getpid()}-{uuid.uuid4().hex[:8]}.ipc")
    endpoints = [f"tcp://{address}:{port}"]
    try:
        inbox.bind(f"ipc://{path}")
        endpoints.insert(0, f"ipc://{path}")
    except zmq.ZMQError:
        pass                                    # no ipc here: tcp serves every peer
    return inbox, endpoints, auth, peer_keys


TOKEN_SUFFIX = ".token"                     # the token file's path: the ipc socket's path plus this


def _ipc_paths(endpoints):
    return [e[len("ipc://"):] for e in endpoints if e.startswith("ipc://")]


def write_ipc_token(endpoints):
    """Write a fresh random token next to each ipc socket path of `endpoints` and return it (""
    when there is no ipc endpoint or the file cannot be written: peers then use tcp). A peer that
    reads the same token back through the path it was given shares this worker's /tmp."""
    paths, token = _ipc_paths(endpoints), secrets.token_hex(16)
    try:
        for path in paths:
            fd = os.open(path + TOKEN_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(token)
    except OSError:
        return ""
    return token if paths else ""


def remove_ipc_files(endpoints):
    """Unlink the ipc socket files of `endpoints` and their token files."""
    for path in _ipc_paths(endpoints):
        for name in (path, path + TOKEN_SUFFIX):
            try:
                os.unlink(name)
            except OSError:
                pass


def ipc_reachable(endpoint, token):
    """True when `endpoint` (ipc://PATH, from a peer's announcement) is reachable from here: the
    token file next to PATH holds the `token` the peer announced. Same host name and network
    namespace do not prove it (containers may share both but not /tmp), and an ipc path that does
    not exist here stalls the step until its timeout. The path comes from the network: the file is
    opened without following a link or blocking (a FIFO there must not hang the worker), must be
    a regular file, and only a token's length of it is read."""
    if not (isinstance(endpoint, str) and endpoint.startswith("ipc://") and isinstance(token, str)
            and 16 <= len(token) <= 128):
        return False
    try:
        fd = os.open(endpoint[len("ipc://"):] + TOKEN_SUFFIX, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except (OSError, ValueError):               # ValueError: a NUL byte in the path
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        found = os.read(fd, 129)
    except OSError:
        return False
    finally:
        os.close(fd)
    return hmac.compare_digest(found, token.encode("ascii", "replace"))
