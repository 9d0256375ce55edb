"""Blocks of a layer's tensors: which rows and channels each worker of a plan holds or needs."""
from hetconv.engine.planner import image_ranges


# A block of a layer's input or output, (N, C, H, W), is (row0, row1, channel0, channel1): the
# rows and channels it covers, every H and W. Each worker holds one block of every layer's output
# and needs one block of every layer's input; between layers each sends every peer what it holds
# of what that peer needs.

def held_blocks(lp, n):
    """Per worker, the block of layer `lp`'s output (a micro-batch of n images) it computes:
    every row of its kernels (model), or its rows of every kernel (data)."""
    if lp.mode == "data":
        return {w: (r0, r1, 0, lp.kernels) for w, (r0, r1) in image_ranges(lp, n).items()}
    return {w: (0, n, s, e) for w, (s, e) in lp.ranges.items()}


def needed_blocks(lp, channels, n):
    """Per worker, the block of layer `lp`'s input (`channels` of them) it computes on: every row
    (model) or its own rows (data), every channel."""
    if lp.mode == "data":
        return {w: (r0, r1, 0, channels) for w, (r0, r1) in image_ranges(lp, n).items()}
    return {w: (0, n, 0, channels) for w in lp.ranges}


def within(block, outer):
    """Index of `block` inside an array that holds block `outer` (block lies in outer)."""
    return (slice(block[0] - outer[0], block[1] - outer[0]), slice(block[2] - outer[2], block[3] - outer[2]))


def block_shape(block):
    return (block[1] - block[0], block[3] - block[2])

