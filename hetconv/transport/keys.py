"""Only workers holding keys are admitted: ZeroMQ CURVE, the Ironhouse pattern.

The coordinator's ROUTER is a CURVE server; a ZAP handler (pyzmq's ThreadAuthenticator) admits
a worker only if its public key is one of the authorised ones, and every refusal is logged with
the peer's address. Workers' DEALERs are CURVE clients that know the coordinator's public key, so
they also know they are talking to the real coordinator. Traffic is encrypted either way.

Key directory, as `hetconv-keygen DIR` writes it (`--worker NAME` adds a worker):

    DIR/coordinator.key_secret        the coordinator's keypair (secret, mode 0600): coordinator host only
    DIR/coordinator.key               the coordinator's public key
    DIR/authorized/NAME.key           one public key per admitted worker: the coordinator admits exactly these
    DIR/workers/NAME/worker.key_secret   worker NAME's keypair (secret, mode 0600)
    DIR/workers/NAME/worker.key          its public key
    DIR/workers/NAME/coordinator.key     a copy of the coordinator's public key

The coordinator reads DIR (`--curve DIR`). A worker reads a folder holding worker.key_secret and
coordinator.key: copy DIR/workers/NAME to the worker's host and pass that folder (`--curve
DIR/workers/NAME`); on the coordinator's own host `--curve DIR` works too while DIR holds a
single worker. Revoking a worker is deleting its authorized/NAME.key (read when the coordinator
starts). The files are zmq certificates (zmq.auth.create_certificates), so czmq tools read them.

Also here: `refuse_open_bind`, which stops an address off loopback from being bound without keys,
and `set_message_limit`, ZeroMQ's per-socket cap on the size of one received frame.
"""
import ipaddress
import os
import re
import shutil
import socket
import tempfile

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

COORDINATOR = "coordinator"


WORKER = "worker"


AUTHORIZED = "authorized"


WORKERS = "workers"


DEFAULT_WORKER = "worker1"


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeyDirError(ValueError):
    """A key directory or key file that is missing, empty or not what hetconv-keygen writes."""


def _private_dir(path):
    """A folder only its owner can enter: its secret files are never readable by others, even in
    the moment between being written and being chmod-ed to 0600."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _keypair(directory, name):
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def make_keys(directory, worker=DEFAULT_WORKER):
    """The coordinator's keypair and one worker's, laid out as the module docstring says.
    Refuses a directory that already holds coordinator keys (new keys would lock out every
    worker holding the old ones). Returns the worker's key folder."""
    if os.path.exists(os.path.join(directory, f"{COORDINATOR}.key_secret")):
        raise KeyDirError(f"{directory} already holds coordinator keys: add a worker with "
                          f"`hetconv-keygen {directory} --worker NAME`, or choose an empty directory")
    _check_name(worker)
    _private_dir(directory)
    _keypair(directory, COORDINATOR)
    _private_dir(os.path.join(directory, AUTHORIZED))
    _private_dir(os.path.join(directory, WORKERS))
    return add_worker(directory, worker)


def add_worker(directory, name):
    """A new worker keypair in DIR/workers/NAME, its public key admitted in DIR/authorized.
    Returns the worker's key folder."""
    _check_name(name)
    coordinator_public, _ = _read_key(os.path.join(directory, f"{COORDINATOR}.key_secret"), secret=True)
    folder = os.path.join(directory, WORKERS, name)
    admitted = os.path.join(directory, AUTHORIZED, f"{name}.key")
    if os.path.exists(folder) or os.path.exists(admitted):
        raise KeyDirError(f"worker {name!r} already has keys in {directory}: choose another --worker NAME")
    _private_dir(os.path.join(directory, AUTHORIZED))
    _private_dir(folder)
    public, _ = _keypair(folder, WORKER)
    shutil.copyfile(public, admitted)
    shutil.copyfile(os.path.join(directory, f"{COORDINATOR}.key"), os.path.join(folder, f"{COORDINATOR}.key"))
    return folder


TEMP_PREFIX = "hetconv-keys-"


def _temp_tag():
    """host and pid in a temp key folder's name: what tells a later run whether its maker is gone."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-"


def remove_stale_key_dirs(parent=None):
    """Remove this user's temp key folders on this host whose making process has died (a
    coordinator or Ray actor killed with -9 cannot remove its own). Folders of live processes,
    of other hosts (a shared /tmp) and of other users are left. Returns the removed paths."""
    parent = parent or tempfile.gettempdir()
    host = _temp_tag().rsplit("-", 2)[0]
    pattern = re.compile(rf"^{re.escape(TEMP_PREFIX + host)}-(\d+)-[A-Za-z0-9_]+$")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        path = os.path.join(parent, name)
        if not m:
            continue
        try:
            if os.lstat(path).st_uid != os.getuid() or os.path.islink(path):
                continue
            os.kill(int(m.group(1)), 0)
            continue                                  # its maker still runs
        except ProcessLookupError:
            pass
        except (PermissionError, OSError):
            continue                                  # alive under another user, or unreadable: not ours to judge
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def private_temp_dir():
    """A new 0700 folder for one process's keys, named with host and pid; stale ones of dead
    processes on this host are removed first."""
    remove_stale_key_dirs()
    return tempfile.mkdtemp(prefix=TEMP_PREFIX + _temp_tag())


def ephemeral_keys(directory):
    """Fresh keys for one run's own workers (`--spawn`): the caller makes `directory` (e.g.
    tempfile.mkdtemp(), mode 0700) and removes it when the run ends. Every spawned worker uses the
    same worker keypair. Returns (coordinator key dir, worker key dir)."""
    return directory, make_keys(directory, worker="spawned")


def first_worker_dir(keydir):
    """A worker key folder of DIR for workers this coordinator spawns itself (any authorised
    worker's keys will do): DIR/workers/NAME, the first by name."""
    workers = os.path.join(keydir, WORKERS)
    names = sorted(n for n in os.listdir(workers)
                   if os.path.isfile(os.path.join(workers, n, f"{WORKER}.key_secret"))) if os.path.isdir(workers) else []
    if not names:
        raise KeyDirError(f"{keydir} holds no worker keypair (workers/NAME/worker.key_secret) for the workers "
                          f"--spawn starts: add one with `hetconv-keygen {keydir} --worker NAME`")
    return os.path.join(workers, names[0])


WORKER_FOLDER_FILES = (f"{WORKER}.key_secret", f"{WORKER}.key", f"{COORDINATOR}.key")


def read_key_folder(folder):
    """A worker key folder's files, {name: bytes}, to recreate it on another host (a Ray actor
    writes them into a private temporary folder there; see hetconv.launch_ray)."""
    worker_keys(folder)                                  # all there, all well-formed
    out = {}
    for name in WORKER_FOLDER_FILES:
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def write_key_folder(files):
    """The inverse of read_key_folder, into a new private temporary folder; returns its path
    (the caller removes it). Any name but the three key files is refused before anything is written."""
    unexpected = sorted(set(files) - set(WORKER_FOLDER_FILES))
    if unexpected:
        raise KeyDirError(f"unexpected key file name {unexpected[0]!r}: expected {', '.join(WORKER_FOLDER_FILES)}")
    folder = private_temp_dir()                          # mode 0700
    for name, content in files.items():
        fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
    return folder


def _check_name(name):
    if not _NAME_RE.match(name or ""):
        raise KeyDirError(f"worker name {name!r} must be letters, digits, '_', '.' or '-' (at most 64), "
                          "starting with a letter or digit")


def _read_key(path, secret):
    """(public, secret or None) from a zmq certificate file, both checked to be 32-byte keys."""
    if not os.path.isfile(path):
        raise KeyDirError(f"missing key file {path}: make keys with `hetconv-keygen DIR`")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyDirError(f"{path} is not a zmq certificate ({e})") from None
    for label, key in (("public-key", public), ("secret-key", secret_key if secret else public)):
        if key is None:
            raise KeyDirError(f"{path} is not a zmq secret certificate: it has no {label} line")
        try:
            ok = len(z85.decode(key)) == 32
        except Exception:
            ok = False
        if not ok:
            raise KeyDirError(f"{path} is not a zmq certificate: its {label} is not a 40-character Z85 key")
    return public, secret_key


def _check_dir(keydir):
    if not keydir or not os.path.isdir(keydir):
        raise KeyDirError(f"no key directory {keydir!r}: make one with `hetconv-keygen DIR`")
    if not os.listdir(keydir):
        raise KeyDirError(f"key directory {keydir} is empty: make keys in it with `hetconv-keygen {keydir}`")


def coordinator_keys(keydir):
    """-> (public, secret, authorised folder) for the coordinator, every file checked."""
    _check_dir(keydir)
    public, secret = _read_key(os.path.join(keydir, f"{COORDINATOR}.key_secret"), secret=True)
    authorized = os.path.join(keydir, AUTHORIZED)
    keys = sorted(n for n in os.listdir(authorized) if n.endswith(".key")) if os.path.isdir(authorized) else []
    if not keys:
        raise KeyDirError(f"{authorized} holds no worker public keys (NAME.key), so no worker could join: "
                          f"add one with `hetconv-keygen {keydir} --worker NAME`")
    for name in keys:
        _read_key(os.path.join(authorized, name), secret=False)
    return public, secret, authorized


def worker_keys(keydir):
    """-> (public, secret, coordinator's public) for a worker. `keydir` is a worker's folder, or a
    whole DIR from hetconv-keygen that holds exactly one worker."""
    _check_dir(keydir)
    if not os.path.exists(os.path.join(keydir, f"{WORKER}.key_secret")):
        workers = os.path.join(keydir, WORKERS)
        names = sorted(os.listdir(workers)) if os.path.isdir(workers) else []
        if len(names) == 1:
            keydir = os.path.join(workers, names[0])
        elif len(names) > 1:
            raise KeyDirError(f"{keydir} holds keys for workers {', '.join(names)}: pass one worker's folder, "
                              f"e.g. --curve {os.path.join(workers, names[0])}")
    public, secret = _read_key(os.path.join(keydir, f"{WORKER}.key_secret"), secret=True)
    server_public, _ = _read_key(os.path.join(keydir, f"{COORDINATOR}.key"), secret=False)
    return public, secret, server_public


class RefusalLog:
    """One line per refused host, not per attempt: a refused peer reconnects every 100 ms, and a
    log that repeats it ten times a second hides everything else. `count` keeps every attempt."""

    def __init__(self, log):
        self.log = log
        self.reported = set()
        self.count = 0

    def refused(self, address, reason):
        self.count += 1
        host = address.split("://")[-1].rsplit(":", 1)[0] if "://" in address else address
        if host not in self.reported:
            self.reported.add(host)
            self.log(f"refused a connection from {host}: {reason} (further attempts from it are refused silently)")


def handshake_refusal(event):
    """A line's reason for a socket-monitor event of a failed CURVE handshake, or None for any
    other event. A peer whose keys come from another hetconv-keygen fails here, before ZAP: it
    does not even hold this coordinator's public key."""
    kind = event.get("event")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "its key is not an authorised worker's"
    if kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return "failed the CURVE handshake (keys from another hetconv-keygen, or no keys)"
    return None


class LoggingAuthenticator(ThreadAuthenticator):
    """ZAP handler that reports each refused connection, with the peer's address, through `log`
    (pyzmq only logs refusals at debug level, with no address next to the reason)."""

    def __init__(self, context, log):
        super().__init__(context)
        self.refusals = log if isinstance(log, RefusalLog) else RefusalLog(log)
        self._peer = "unknown address"

    @property
    def refused(self):
        return self.refusals.count

    def handle_zap_message(self, msg):
        # ZAP request frames: version, request id, domain, address, identity, mechanism, credentials
        if len(msg) > 3:
            self._peer = msg[3].decode("utf-8", "replace") or "unknown address"
        return super().handle_zap_message(msg)      # a coroutine on pyzmq >= 25: the caller awaits it

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
        if status_code != b"200":
            self.refusals.refused(self._peer, f"{status_text.decode('utf-8', 'replace')}: its key is not an "
                                              "authorised worker's")
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


def serve_curve(ctx, sock, keydir, log=print, also=()):
    """Make `sock` (the coordinator's ROUTER, not yet bound) and the sockets in `also` (its
    heartbeat channel) CURVE servers that admit only the worker keys in keydir/authorized, and
    start the ZAP handler that checks them on `ctx` (one per context). Call before bind: a
    connection accepted before the handler runs would skip the check. `log` is called from the
    authenticator's thread, once per refused connection. Returns the authenticator; call its
    .stop() before terminating the context."""
    public, secret, authorized = coordinator_keys(keydir)
    return _start_zap(ctx, log, lambda auth: auth.configure_curve(domain="*", location=authorized),
                      (sock, *also), public, secret)


def _start_zap(ctx, log, configure, servers, public, secret):
    """Start a ZAP handler on `ctx`, `configure` it, and make `servers` CURVE servers with this
    keypair; on any failure the handler is stopped again. Returns the handler."""
    auth = LoggingAuthenticator(ctx, log)
    auth.start()
    try:
        configure(auth)
        for server in servers:
            _make_server(server, public, secret)
    except BaseException:
        auth.stop()
        raise
    return auth


def _make_client(sock, public, secret, server_public):
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def _make_server(sock, public, secret):
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def authenticated_key(frame):
    """The z85 public key ZAP authenticated for the connection `frame` (received with
    copy=False) came over, or "" on a connection without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except Exception:                  # no metadata on this frame (an inproc or NULL connection)
        return ""


class PeerKeys:
    """ZAP credentials for a worker's peer inbox: only the public keys of the plan's other
    workers, as the coordinator authenticated them (never as a worker claims), are admitted.
    `allowed` is replaced at each PEERS."""

    def __init__(self):
        self.allowed = frozenset()

    def callback(self, domain, key):
        return key.decode("ascii", "replace") in self.allowed


def serve_peers(ctx, sock, keydir, log=print):
    """Make `sock` (a worker's peer inbox, not yet bound) a CURVE server with the worker's own
    keypair, and start a ZAP handler on `ctx` that admits the keys in the returned PeerKeys.
    Returns (authenticator, PeerKeys); stop the authenticator before terminating the context."""
    public, secret, _ = worker_keys(keydir)
    keys = PeerKeys()
    auth = _start_zap(ctx, log, lambda a: a.configure_curve_callback(domain="*", credentials_provider=keys),
                      (sock,), public, secret)
    return auth, keys


def connect_peer(sock, keydir, peer_public):
    """Make `sock` (a PUSH to another worker's inbox, not yet connected) a CURVE client with this
    worker's keypair that talks only to the holder of `peer_public` (z85)."""
    public, secret, _ = worker_keys(keydir)
    _make_client(sock, public, secret, peer_public.encode("ascii") if isinstance(peer_public, str) else peer_public)


def own_public_key(keydir):
    """This worker's z85 public key (as the coordinator's ZAP will report it)."""
    return worker_keys(keydir)[0].decode("ascii")


def connect_curve(sock, keydir):
    """Make `sock` (a worker's DEALER, not yet connected) a CURVE client with the worker's keypair
    that only talks to the coordinator holding the matching secret key. Call before connect."""
    _make_client(sock, *worker_keys(keydir))


def set_message_limit(sock, nbytes):
    """Cap one received frame at `nbytes` (ZMQ_MAXMSGSIZE): a peer that sends a bigger one is
    disconnected and the frame is never delivered, so a bad peer cannot make this process
    allocate without bound. Set it before bind/connect; the limit applies per frame."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
        raise ValueError(f"message limit must be a positive number of bytes, got {nbytes!r}")
    sock.setsockopt(zmq.MAXMSGSIZE, nbytes)


def is_loopback(address):
    """True for addresses only this host can reach: ipc://, inproc://, tcp on 127.0.0.0/8, ::1 or
    localhost. Anything else (0.0.0.0, *, a host name, an interface name) counts as open."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_open_bind(address, curve_dir, insecure):
    """Raise ValueError when `address` is reachable from other hosts and no keys were given:
    anyone reaching it could join as a worker and receive the training data and weights."""
    if curve_dir or insecure or is_loopback(address):
        return
    raise ValueError(f"refusing to bind {address} without keys: any host that reaches it could join as a "
                     "worker and receive the training data and weights. Make keys with `hetconv-keygen DIR`, "
                     "then pass `--curve DIR` to the coordinator and every worker; or pass --insecure to bind "
                     "it open anyway")
