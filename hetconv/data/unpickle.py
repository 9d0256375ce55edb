"""Restricted unpickling for data files that are pickles (CIFAR-10 and CIFAR-100).

Unpickling runs whatever callable the file names, so these files are read with an unpickler that
admits only what plain containers and numpy arrays need and refuses everything else before it is
called.

A small pickle can also stand for a huge object without naming any callable: a list memoised once
and referenced twice from the next list, 30 levels deep, is 60 bytes of references that anything
walking the result (np.asarray, repr, a hash) expands to 2**30 elements. So the unpickler sizes every
object as it builds it, the way a walk would see it: a container is 8 bytes per slot plus the sizes
of what it holds, counted again at every reference; bytes, text and arrays their length. A plain data
file expands to about its own size (each element or byte stands once in the file), so anything over
twice the file's size plus 1 MiB is refused the moment a container passes it, before the memory is
spent. Containers changed after they were placed in another (the only way to undercount) and
containers placed inside themselves are refused: no data file needs them. Lengths the file declares
(a bytes object, a frame) are checked against what is left of the file before they are read.

The pure-Python unpickler runs this (the C one has no hook per opcode): about 0.1 s for a CIFAR-10
batch of 10000 labels and file names, whose 30 MB of pixels are read in one piece either way.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np

from hetconv.data.base import DataError

# The numpy callables an array pickle names, resolved from numpy itself rather than by import:
# numpy 1.x files say numpy.core.multiarray, numpy 2.x files say numpy._core.multiarray, and
# importing numpy.core on numpy 2 only to find the same function warns.
_np_reconstruct = np.ndarray.__reduce__(np.zeros(1, np.uint8))[0]
_scalar = np.uint8(0).__reduce__()[0]
_frombuffer = np.zeros(1, np.uint8).__reduce_ex__(5)[0]    # what protocol 5 pickles name

ELEMENT = 8                       # what one slot of a container, or one number, counts for
EXPANSION_FLOOR = 1 << 20         # the allowance over twice the file's size (small files, meta files)
# dtype flags that make numpy treat an item's bytes as Python objects or pointers (object dtypes):
# a pickled dtype's state can set them on a plain void dtype, and an array of it then dereferences
# whatever bytes the file holds.
_OBJECT_FLAGS = 0x01 | 0x02 | 0x04 | 0x20 | 0x40
_ATOMS = (int, float, complex, bool, bytes, str, type(None))


def _latin1_encode(text, encoding="latin1"):
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(str, "latin1"). codecs.encode
    # with another codec name is not needed by any array file, so only latin-1 is let through.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode is only allowed for latin1 text, "
                                     f"got encoding {encoding!r}")
    return text.encode("latin1")


def _reconstruct(subtype, shape, dtype):
    # numpy pickles every array as an empty one of shape (0,) whose state (BUILD) then gives its
    # shape and bytes; an empty array of a shape the file names would be allocated here, unread.
    if subtype is not np.ndarray or not isinstance(shape, tuple) or any(not isinstance(d, int) for d in shape) \
            or 0 not in shape:
        raise pickle.UnpicklingError(f"an array is rebuilt from shape (0,), as numpy writes it; got {shape!r:.80}")
    return _np_reconstruct(subtype, shape, dtype)


def _dtype(spec, align=False, copy=False):
    dtype = np.dtype(spec, align, copy)
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"dtype {dtype} holds Python objects; a data file holds numbers")
    return dtype


_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): _scalar,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _Bounded:
    """The file as the unpickler reads it: a read longer than what is left is refused before it is
    made (a declared length is the file's word, and reading it would allocate it)."""

    def __init__(self, file, size: int, source: str, what: str):
        self.file, self.left, self.source, self.what = file, size, source, what

    def read(self, n):
        if n > self.left:
            raise DataError(f"{self.source}: not a readable {self.what} pickle (truncated or a different file?): "
                            f"it needs {n} more bytes where {max(self.left, 0)} are left")
        data = self.file.read(n)
        self.left -= len(data)
        return data

    def readline(self):
        line = self.file.readline(self.left) if self.left > 0 else b""
        self.left -= len(line)
        return line


_base = pickle._Unpickler.dispatch
_op = {name: getattr(pickle, name)[0] for name in (
    "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD", "REDUCE", "TUPLE", "TUPLE1", "TUPLE2",
    "TUPLE3", "LIST", "DICT", "FROZENSET", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE", "NEWOBJ",
    "NEWOBJ_EX", "OBJ", "INST", "BYTEARRAY8")}


class _DataUnpickler(pickle._Unpickler):
    """Unpickler for data files: plain containers and numpy arrays, nothing that runs code, and
    nothing that expands past what the file's size makes plausible."""

    dispatch = dict(_base)

    def __init__(self, file, source: str, what: str, size: int):
        # encoding="bytes": the official files were pickled by Python 2, whose str is bytes.
        super().__init__(_Bounded(file, size, source, what), encoding="bytes")
        self.source = source
        self.file_size = size
        self.cap = 2 * size + EXPANSION_FLOOR
        self.sizes = {}          # id -> expanded size of each container or array built here
        self.placed = {}         # id -> object, for everything placed in a container or passed as arguments
        self.kept = []           # every sized object, alive until the end: no id is reused meanwhile

    def find_class(self, module, name):
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise DataError(f"{self.source}: refusing to unpickle {module}.{name}: only plain "
                            f"containers and numpy arrays are allowed")
        return allowed

    def persistent_load(self, pid):
        raise DataError(f"{self.source}: refusing a persistent id in the pickle: only plain "
                        f"containers and numpy arrays are allowed")

    # ---- sizes ----------------------------------------------------------------------------------

    def size_of(self, obj) -> int:
        known = self.sizes.get(id(obj))
        if known is not None:
            return known
        if isinstance(obj, (bytes, bytearray, str)):
            return ELEMENT + len(obj)
        if isinstance(obj, np.ndarray):
            return ELEMENT + obj.nbytes
        return ELEMENT

    def set_size(self, obj, size: int):
        if size > self.cap:
            raise DataError(f"{self.source}: its containers expand to more than {self.cap} bytes (shared references "
                            f"counted at each use) from a file of {self.file_size}: refused (a data file expands to "
                            f"about its own size)")
        if id(obj) not in self.sizes:
            self.kept.append(obj)
        self.sizes[id(obj)] = size

    def place(self, items):
        for item in items:
            if not isinstance(item, _ATOMS):
                self.placed[id(item)] = item

    def grow(self, target, items):
        """`items` go into `target`, which already exists: size it anew, or refuse."""
        if id(target) in self.placed:
            raise DataError(f"{self.source}: the pickle changes a {type(target).__name__} after placing it in "
                            f"another; a data file builds each container before it uses it")
        if any(item is target for item in items):
            raise DataError(f"{self.source}: the pickle places a {type(target).__name__} inside itself; "
                            f"a data file holds no such thing")
        self.set_size(target, self.size_of(target) + sum(self.size_of(item) for item in items))
        self.place(items)

    def built(self, items):
        """The container on the stack was just made from `items`."""
        self.set_size(self.stack[-1], ELEMENT + sum(self.size_of(item) for item in items))
        self.place(items)


def _register(name):
    def wrap(handler):
        _DataUnpickler.dispatch[_op[name]] = handler
        return handler
    return wrap


def _growing(name, target_items):
    original = _base[_op[name]]

    def handler(self):
        target, items = target_items(self)
        self.grow(target, items)
        original(self)
    _register(name)(handler)


# APPEND, SETITEM: the target and the items are on the stack; the *S forms after a mark.
_growing("APPEND", lambda u: (u.stack[-2], u.stack[-1:]))
_growing("SETITEM", lambda u: (u.stack[-3], u.stack[-2:]))
for _name in ("APPENDS", "SETITEMS", "ADDITEMS"):
    _growing(_name, lambda u: (u.metastack[-1][-1], u.stack))


def _building(name, items_of):
    original = _base[_op[name]]

    def handler(self):
        items = list(items_of(self))
        original(self)
        self.built(items)
    _register(name)(handler)


for _name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
    _building(_name, lambda u: u.stack)
for _n, _name in enumerate(("TUPLE1", "TUPLE2", "TUPLE3"), start=1):
    _building(_name, lambda u, n=_n: u.stack[-n:])
for _name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"):
    _building(_name, lambda u: ())


@_register("REDUCE")
def _load_reduce(self):
    self.place(self.stack[-1])                       # the arguments: consumed, never to change again
    _base[_op["REDUCE"]](self)


@_register("BUILD")
def _load_build(self):
    inst, state = self.stack[-2], self.stack[-1]
    if id(inst) in self.placed:
        raise DataError(f"{self.source}: the pickle sets the state of a {type(inst).__name__} after placing it "
                        f"in another; a data file builds each object before it uses it")
    if isinstance(inst, np.ndarray):
        dtype = state[-3] if isinstance(state, tuple) and len(state) >= 4 else None
        if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(state[-1], (bytes, bytearray)):
            raise DataError(f"{self.source}: an array's state is not (shape, dtype, order, bytes) of numbers")
    elif isinstance(inst, np.dtype):
        flags = state[-1] if isinstance(state, tuple) and state else None
        if not isinstance(flags, int) or flags & _OBJECT_FLAGS:
            raise DataError(f"{self.source}: a dtype's state marks it as holding Python objects or pointers; "
                            f"a data file holds numbers")
    else:
        raise DataError(f"{self.source}: the pickle sets the state of a {type(inst).__name__}; only numpy arrays "
                        f"and dtypes take one in a data file")
    self.place([state])
    _base[_op["BUILD"]](self)
    if isinstance(inst, np.dtype) and inst.hasobject:
        raise DataError(f"{self.source}: dtype {inst} holds Python objects; a data file holds numbers")
    if isinstance(inst, np.ndarray):
        self.set_size(inst, ELEMENT + inst.nbytes)


def _refused(name):
    def handler(self):
        raise DataError(f"{self.source}: the pickle builds an object of a class ({name}); plain containers "
                        f"and numpy arrays never need it")
    _register(name)(handler)


for _name in ("NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"):
    _refused(_name)


@_register("BYTEARRAY8")
def _load_bytearray8(self):
    (length,) = struct.unpack("<Q", self.read(8))
    if length > self.file_size:                      # bytearray(length) is allocated before it is read
        raise DataError(f"{self.source}: the pickle declares a bytearray of {length} bytes in a file of "
                        f"{self.file_size}")
    buffer = bytearray(length)
    self.readinto(buffer)
    self.append(buffer)


def restricted_load(stream, source: str, what: str, size: int):
    """The object pickled in `stream` (a file named `source` of `size` bytes), or DataError naming it.
    The file's size bounds what the pickle may declare and what it may expand to."""
    try:
        return _DataUnpickler(stream, source, what, size).load()
    except DataError:
        raise
    except RecursionError:
        raise DataError(f"{source}: not a readable {what} pickle: nested too deeply") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise DataError(f"{source}: not a readable {what} pickle (truncated or a different "
                        f"file?): {type(e).__name__}: {e}") from None
