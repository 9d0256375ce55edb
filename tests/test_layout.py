"""The package's layout holds: every subpackage imports only from the floors below it, nothing on
the worker side imports the coordinator side or the reverse, there is no import cycle between
modules, and imports sit at the top of modules except where an optional dependency is loaded on
demand (or the worker pins its cores before numpy starts its thread pools)."""
import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hetconv")

# A place may import from places on lower floors only (and from itself).
FLOORS = {
    "sizes": 0, "update": 0, "params": 0, "flags": 0, "jit": 0, "runtimes": 0,
    "__init__": 1,      # pins the runtimes (runtimes.py) before anything below loads Numba
    "channelwise": 1,
    "geometry": 2,
    "devices": 3, "net": 3, "data": 3, "transport": 3,
    "engine": 4,
    "worker": 5, "coordinator": 5, "training": 5,
    "cli": 6,
    "api": 7,
}
# Loaded inside a function on purpose: optional extras, and the worker's serve loop after pinning.
DEFERRED_OK = ("torch", "ray", "PIL", "simplejpeg", "matplotlib", "onnx", "onnxruntime", "onnxscript", "numba.cuda",
               "hetconv.devices.cuda")
# The package root hands out the Python API (hetconv.train, hetconv.load, ...) on first use, from a
# module __getattr__: an import at its top would load the commands, the coordinator and Numba into
# every process that imports any hetconv module, a worker's included. The only import that goes
# up, and only from inside a function.
LAZY_UP = {("__init__.py", "hetconv.api")}
# The photo decoder's compiled resize loads Numba in the processes that decode photos only, not in
# those that list a folder or check its headers.
# The runtimes' pinning sets Numba's environment before Numba is imported, so it asks Numba only
# from inside its functions, after that.
DEFERRED_PLACES = {("cli/worker.py", "hetconv.worker.serve"), ("data/photos.py", "hetconv.data.resample"),
                   ("runtimes.py", "numba"), *LAZY_UP}


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, PACKAGE)
                dotted = "hetconv." + rel[:-3].replace(os.sep, ".")
                yield rel, dotted.removesuffix(".__init__"), ast.parse(open(path).read(), path)


def place(dotted):
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(tree):
    """(module imported, inside a function?) for every import statement."""
    def walk(node, inside):
        for child in ast.iter_child_nodes(node):
            nested = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, nested
            elif isinstance(child, ast.ImportFrom) and child.module:
                if child.module == "hetconv":
                    for a in child.names:
                        yield f"hetconv.{a.name}", nested
                else:
                    yield child.module, nested
            yield from walk(child, nested)
    yield from walk(tree, False)


def internal_target(name, known):
    """The hetconv module an import names, or None for another package."""
    if not name.startswith("hetconv"):
        return None
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]              # `from hetconv.x import name`: name is not a module
    return name


ALL = list(modules())
KNOWN = {dotted for _, dotted, _ in ALL}


def test_every_place_has_a_floor():
    assert {place(d) for _, d, _ in ALL} <= set(FLOORS), {place(d) for _, d, _ in ALL} - set(FLOORS)


@pytest.mark.parametrize("rel,dotted,tree", ALL, ids=[r for r, _, _ in ALL])
def test_imports_go_down_only(rel, dotted, tree):
    here = place(dotted)
    for name, inside in imported(tree):
        target = internal_target(name, KNOWN)
        if target is None or target == "hetconv" or place(target) == here:
            continue
        if inside and (rel.replace(os.sep, "/"), target) in LAZY_UP:
            continue
        there = place(target)
        assert FLOORS[there] < FLOORS[here], (f"{rel} imports {target}: {there} (floor {FLOORS[there]}) is not below "
                                              f"{here} (floor {FLOORS[here]})")


@pytest.mark.parametrize("rel,dotted,tree", ALL, ids=[r for r, _, _ in ALL])
def test_imports_sit_at_the_top(rel, dotted, tree):
    for name, inside in imported(tree):
        if not inside:
            continue
        optional = any(name == m or name.startswith(m + ".") for m in DEFERRED_OK)
        assert optional or (rel.replace(os.sep, "/"), name) in DEFERRED_PLACES, \
            f"{rel} imports {name} inside a function: move it to the top (only optional extras load on demand)"


def test_no_import_cycle_between_modules():
    graph = {dotted: set() for dotted in KNOWN}
    for _, dotted, tree in ALL:
        for name, inside in imported(tree):
            target = internal_target(name, KNOWN)
            if target and target != dotted and not inside and target != "hetconv":
                graph[dotted].add(target)
    # a package's __init__ re-exporting its own modules is not a cycle through them
    for dotted in graph:
        graph[dotted] = {t for t in graph[dotted] if not dotted.startswith(t + ".") or t == "hetconv"}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The floor check itself: a worker module importing the coordinator fails it."""
    tree = ast.parse("from hetconv.coordinator.remote import RemoteEngine\n")
    with pytest.raises(AssertionError, match="not below"):
        test_imports_go_down_only("worker/x.py", "hetconv.worker.x", tree)
    # the package root's lazy API is the one way up, and only from inside a function
    with pytest.raises(AssertionError, match="not below"):
        test_imports_go_down_only("__init__.py", "hetconv", ast.parse("from hetconv import api\n"))
    test_imports_go_down_only("__init__.py", "hetconv", ast.parse("def f():\n    from hetconv import api\n"))
    with pytest.raises(AssertionError, match="inside a function"):
        test_imports_sit_at_the_top("train/x.py", "hetconv.training.x", ast.parse("def f():\n    import json\n"))


# The engine, the workers and the coordinator carry the step and its plan: a function there that
# one reader cannot hold at once (over 80 lines, its docstring included) is split into named parts.
LONGEST_FUNCTION = 80
SHORT_PLACES = ("engine", "worker", "coordinator")


@pytest.mark.parametrize("rel,dotted,tree", [m for m in ALL if place(m[1]) in SHORT_PLACES],
                         ids=[r for r, d, _ in ALL if place(d) in SHORT_PLACES])
def test_functions_of_the_engine_workers_and_coordinator_stay_short(rel, dotted, tree):
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert not long, f"{rel}: {', '.join(long)} over {LONGEST_FUNCTION} lines: split into named parts"


def test_the_length_rule_catches_a_long_function():
    body = "def f():\n" + "    x = 1\n" * LONGEST_FUNCTION
    with pytest.raises(AssertionError, match="over 80 lines"):
        test_functions_of_the_engine_workers_and_coordinator_stay_short("engine/x.py", "hetconv.engine.x",
                                                                        ast.parse(body))
