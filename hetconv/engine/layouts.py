"""Where a graph step's tensors live among the workers: each worker's rows of a tensor, each
worker's channels of it (a model block's output: the channels its kernels make, every image), or
the whole tensor on every worker (worker/blocks.py says which block of one layer each worker
holds).

A data block reads and writes rows; a model block reads its input whole and leaves its output in
its channel ranges (`channels(block)`), made whole, or cut into rows, only where a reader needs
that; a BatchNorm between blocks reads the whole tensor (its statistics are the whole batch's); a
join (a sum, an activation or a pool) of operands in one layout gives that layout; where they
differ it reads rows where any operand is in rows or channels (an all-to-all moves 1/P of what an
all-gather does), one block's channels where the rest are whole (taking them moves nothing), and
else the whole. A concatenation reads rows or the whole: channel ranges side by side are not one
block's channels. Between layouts: whole to rows or channels takes one's own part and moves
nothing; rows or channels to anything else send each worker what it lacks of its part (rows to
whole, channels to whole: an all-gather; channels to rows: an all-to-all). So an all-data graph
moves no feature maps at all between its blocks, a model block feeding a model block gathers its
channels once, and a graph whose late blocks are model-parallel gathers once where it turns from
data to model. Gradients take their tensor's layout: a model block's partial dX is summed into the
layout of its input (a reduce-scatter where that is rows or channels, an all-reduce where it is
whole); a complete gradient held in another layout than its tensor's moves as a tensor does.
"""
from hetconv.net.spec import Concat

ROWS, WHOLE = "rows", "whole"


def intersect(a, b):
    """The block (r0, r1, c0, c1) two blocks share, or None when they share no element (rows and
    channels in any unit: a worker's images and kernels, or fractions of them)."""
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


def contains(outer, inner):
    """Whether block `inner` lies in block `outer` (an empty one lies anywhere)."""
    if inner[0] >= inner[1] or inner[2] >= inner[3]:
        return True
    return outer[0] <= inner[0] and inner[1] <= outer[1] and outer[2] <= inner[2] and inner[3] <= outer[3]


def channels(block):
    """The layout of model block `block`'s output: each worker its kernels' channels of every image."""
    return ("channels", int(block))


def is_channels(layout):
    return isinstance(layout, tuple) and layout[0] == "channels"


def _is_concat(step):
    return step.kind == "concat" or isinstance(getattr(step, "layer", None), Concat)


def step_reads(step, modes, norms, layouts):
    """The layout `step` (an engine/graph GraphStep) reads its inputs in."""
    if step.kind == "block":
        return ROWS if modes[step.block] == "data" else WHOLE
    if step.output in norms:
        return WHOLE
    have = list(dict.fromkeys(layouts[j] for j in step.inputs))
    if _is_concat(step):
        return ROWS if ROWS in have else WHOLE
    if len(have) == 1:
        return have[0]
    if ROWS in have:
        return ROWS
    parts = [h for h in have if h != WHOLE]
    return parts[0] if len(parts) == 1 else WHOLE


def step_makes(step, modes, norms, layouts):
    """The layout `step` leaves its output in."""
    if step.kind == "block" and modes[step.block] != "data":
        return channels(step.block)
    return step_reads(step, modes, norms, layouts)


def tensor_layouts(steps, modes, norms):
    """{tensor: its layout} of every tensor the steps make, -1 (the images) held in rows."""
    layouts = {-1: ROWS}
    for st in steps:
        layouts[st.output] = step_makes(st, modes, norms, layouts)
    return layouts


def read_in(steps, reads, layouts):
    """{tensor: the layouts other than its own that steps read it in} (`reads(step)`: a step's
    read layout). Where one of them is the whole, the tensor is made whole once and its other
    readers take their parts of that (moving nothing more): conversion_source."""
    wanted = {}
    for st in steps:
        want = reads(st)
        for j in st.inputs:
            if layouts[j] != want and want not in wanted.setdefault(j, []):
                wanted[j].append(want)
    return wanted


def conversion_source(j, want, layouts, wanted):
    """The layout tensor j is converted to `want` from: the whole where it is also read whole."""
    return WHOLE if want != WHOLE and WHOLE in wanted.get(j, ()) else layouts[j]

