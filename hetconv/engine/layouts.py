"""Where a step's tensors live among the workers, beyond one layer's blocks (worker/blocks.py)."""
from hetconv.engine.planner import image_ranges


def data_rows(layer_plans, sizes):
    """Where every conv block of a graph is data-parallel and splits each micro-batch of `sizes`
    images the same way in every block: per worker, its rows [r0, r1) of each micro-batch, which
    it then holds of every tensor of the graph (a block reads and writes its own rows; a sum, a
    concatenation, an activation or a pool of rows is the rows of the result). Else None: some
    block needs a tensor whole. Such a step moves what data parallelism must: the BatchNorm sums
    and the weight gradients among the workers, the images and features to and from the
    coordinator."""
    if not layer_plans or any(lp.mode != "data" for lp in layer_plans):
        return None
    rows = {w: [] for w in layer_plans[0].images}
    for n in sizes:
        first = image_ranges(layer_plans[0], n)
        if any(image_ranges(lp, n) != first for lp in layer_plans[1:]):
            return None
        for w, r in first.items():
            rows[w].append(r)
    return rows
