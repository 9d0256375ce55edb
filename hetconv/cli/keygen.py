"""`hetconv-keygen`: make the CURVE key directory that a coordinator and its workers share."""
import argparse
import os
import sys

from hetconv.flags import add_version
from hetconv.transport import keys
from hetconv.transport.keys import DEFAULT_WORKER, KeyDirError, add_worker, make_keys


def main(argv=None):
    layout = keys.__doc__[keys.__doc__.index("Key directory"):keys.__doc__.index("Also here")].rstrip()
    p = argparse.ArgumentParser(
        prog="hetconv-keygen", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Make CURVE keys so that only your workers can join a coordinator that listens off "
                    "loopback.\n\n" + layout,
        epilog="example: hetconv-keygen keys && hetconv-keygen keys --worker gpu-box\n"
               "then: hetconv-coordinator --bind tcp://0.0.0.0:5555 --curve keys ...\n"
               "      hetconv-worker --connect tcp://HOST:5555 --curve keys/workers/gpu-box ...")
    p.add_argument("dir", help="the key directory (made if missing)")
    p.add_argument("--worker", metavar="NAME",
                   help="add a keypair for worker NAME to an existing DIR (without it: make DIR's coordinator "
                        f"keys and a first worker, {DEFAULT_WORKER!r})")
    add_version(p)
    args = p.parse_args(argv)
    try:
        if args.worker:
            if not os.path.isdir(args.dir):
                raise KeyDirError(f"no key directory {args.dir}: make it first with `hetconv-keygen {args.dir}`")
            folder = add_worker(args.dir, args.worker)
        else:
            folder = make_keys(args.dir)
    except (KeyDirError, OSError) as e:
        print(f"hetconv-keygen: {e}", file=sys.stderr)
        return 2
    print(f"worker keys in {folder}: copy that folder to the worker's host and pass --curve {folder}; "
          f"the coordinator takes --curve {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
