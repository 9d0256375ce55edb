"""Where a graph step's tensors live among the workers: each worker's rows of a tensor, or the
whole tensor on every worker (worker/blocks.py says which block of one layer each worker holds).

A data block reads and writes rows; a model block reads its input whole and its output is made
whole (its channel blocks all-gathered); a BatchNorm between blocks reads the whole tensor (its
statistics are the whole batch's); a join (a sum, a concatenation, an activation or a pool) of
rows gives rows, of whole tensors a whole one, and where its operands differ reads the rows of the
whole ones. Between layouts: rows to whole is an all-gather, whole to rows takes one's own rows
and moves nothing. So an all-data graph moves no feature maps at all between its blocks, and a
graph whose late blocks are model-parallel gathers once where it turns from data to model.
Gradients take their tensor's layout: one read whole by a model block and held in rows takes its
rows of the summed gradient; one held whole and read in rows gathers its readers' rows.
"""
ROWS, WHOLE = "rows", "whole"


def step_layout(step, modes, norms, layouts):
    """The layout `step` (an engine/graph GraphStep) reads its inputs in and makes its output in."""
    if step.kind == "block":
        return ROWS if modes[step.block] == "data" else WHOLE
    if step.output in norms:
        return WHOLE
    return WHOLE if all(layouts[j] == WHOLE for j in step.inputs) else ROWS


def tensor_layouts(steps, modes, norms):
    """{tensor: ROWS or WHOLE} of every tensor the steps make, -1 (the images) held in rows."""
    layouts = {-1: ROWS}
    for st in steps:
        layouts[st.output] = step_layout(st, modes, norms, layouts)
    return layouts
