"""Where a graph step's tensors live among the workers: each worker's rows of a tensor, each
worker's channels of it (a model block's output: the channels its kernels make, every image), or
the whole tensor on every worker; `pieces` says which blocks (rows by channels) of it each
worker holds.

A data block reads and writes rows; a model block reads its input whole and leaves its output in
its channel ranges (`channels(block)`), made whole, or cut into rows, only where a reader needs
that; a BatchNorm between blocks reads the whole tensor (its statistics are the whole batch's); a
join (a sum, an activation or a pool) of operands in one layout gives that layout; where they
differ it reads rows where any operand is in rows or channels (an all-to-all moves 1/P of what an
all-gather does), one block's channels where the rest are whole (taking them moves nothing), and
else the whole. A concatenation of operands all held in channel ranges is a renumbering: each
operand stays where it is, and the result is held in each worker's ranges of every operand, side
by side (`concatenated`), moving nothing; else it reads rows where any operand is in rows, or the
whole. Between layouts: whole to anything takes one's own part and moves nothing; rows or
channels to anything else send each worker what it lacks of its part (rows to whole, channels to
whole: an all-gather; channels to rows: an all-to-all), in one message per pair of workers
however many ranges a worker holds (`pieces`, `meeting`). So an all-data graph
moves no feature maps at all between its blocks, a model block feeding a model block gathers its
channels once, and a graph whose late blocks are model-parallel gathers once where it turns from
data to model. Gradients take their tensor's layout: a model block's partial dX is summed into the
layout of its input (a reduce-scatter where that is rows or channels, an all-reduce where it is
whole); a complete gradient held in another layout than its tensor's moves as a tensor does.
"""
from hetconv.net.spec import Concat

ROWS, WHOLE = "rows", "whole"
CONCATENATED = "concatenated"


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


def concatenated(blocks):
    """The layout of a concatenation whose operands are held in model blocks' channel ranges:
    each worker holds its kernels' channels of each operand, side by side in its array;
    `blocks`: the model block whose channels each operand's ranges are, in channel order."""
    return (CONCATENATED, tuple(int(b) for b in blocks))


def is_concatenated(layout):
    return isinstance(layout, tuple) and layout[0] == CONCATENATED


def channel_blocks(layout):
    """The model blocks whose kernels' channel ranges make `layout`, in channel order (none for
    rows or the whole)."""
    if is_channels(layout):
        return (layout[1],)
    return layout[1] if is_concatenated(layout) else ()


def pieces(layout, n, channels, rows, kernel_range, kernels):
    """The blocks (r0, r1, c0, c1) of a micro-batch of n images of a tensor of `channels` that a
    worker holds in `layout`, in the order its array holds them side by side along the channels
    (each has every row of the array): `rows`, its rows (r0, r1) of the micro-batch;
    `kernel_range(b)`, its kernels (k0, k1) of model block b; `kernels(b)`, b's kernel count."""
    if layout == WHOLE:
        return [(0, n, 0, channels)]
    if layout == ROWS:
        return [tuple(rows) + (0, channels)]
    out, offset = [], 0
    for b in channel_blocks(layout):
        k0, k1 = kernel_range(b)
        out.append((0, n, offset + k0, offset + k1))
        offset += kernels(b)
    return out


def pieces_shape(held):
    """(rows, channels) of the array that holds blocks `held` side by side."""
    return held[0][1] - held[0][0], sum(c1 - c0 for _, _, c0, c1 in held)


def covered(held, needed):
    """Whether every block of `needed` lies in one of `held`."""
    return all(any(contains(h, p) for h in held) for p in needed)


def meeting(held, needed):
    """[(block, i, k)]: each block where held[i] and needed[k] share elements, in needed's order,
    then held's: the order in which one message carries them side by side along the channels
    (they share their rows, as the blocks of one worker's array do)."""
    out = []
    for k, want in enumerate(needed):
        for i, have in enumerate(held):
            part = intersect(have, want)
            if part is not None:
                out.append((part, i, k))
    return out


def index_in(block, held, i):
    """The index of `block`, which lies in held[i], in an array holding `held` side by side."""
    piece = held[i]
    c = sum(p[3] - p[2] for p in held[:i]) - piece[2]
    return (slice(block[0] - piece[0], block[1] - piece[0]), slice(c + block[2], c + block[3]))


def _is_concat(step):
    return step.kind == "concat" or isinstance(getattr(step, "layer", None), Concat)


def step_reads(step, modes, norms, layouts):
    """The layout `step` (an engine/graph GraphStep) reads its inputs in (a renumbering
    concatenation: the layout it makes, each operand read as held: input_layout)."""
    if step.kind == "block":
        return ROWS if modes[step.block] == "data" else WHOLE
    if step.output in norms:
        return WHOLE
    have = list(dict.fromkeys(layouts[j] for j in step.inputs))
    if _is_concat(step):
        if all(channel_blocks(h) for h in have):
            return concatenated(b for j in step.inputs for b in channel_blocks(layouts[j]))
        return ROWS if ROWS in have else WHOLE
    if len(have) == 1:
        return have[0]
    if ROWS in have:
        return ROWS
    parts = [h for h in have if h != WHOLE]
    return parts[0] if len(parts) == 1 else WHOLE


def input_layout(step, k, want, layouts):
    """The layout `step`, reading in `want` (step_reads), reads its k-th input in: a renumbering
    concatenation each operand as it is held, any other step `want` (None where nothing is held
    in layouts: GraphPass in one process)."""
    if is_concatenated(want) and _is_concat(step):
        return layouts[step.inputs[k]]
    return want


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
        reading = reads(st)
        for k, j in enumerate(st.inputs):
            want = input_layout(st, k, reading, layouts)
            if layouts[j] != want and want not in wanted.setdefault(j, []):
                wanted[j].append(want)
    return wanted


def conversion_source(j, want, layouts, wanted):
    """The layout tensor j is converted to `want` from: the whole where it is also read whole."""
    return WHOLE if want != WHOLE and WHOLE in wanted.get(j, ()) else layouts[j]

