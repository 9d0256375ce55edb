"""A conv layer as a shard runs it over one step: the conv, fused with the activation and pool
that follow it where the device has that fused form (ConvSpec.block), then the layer's tail of
per-channel ops (hetconv.channelwise), forward and backward over the step's micro-batches.

Every tail op works per channel, so it runs where the channel is, on whatever images this shard
holds of it, with one exception: BatchNorm in training normalises with statistics of the step's
WHOLE batch, as PyTorch computes them in one process. Its forward needs the per-channel sums of
every image first, its backward the sums of dy and dy*x_hat: each is a barrier. Up to the first
barrier a micro-batch runs as soon as it arrives; at a barrier every micro-batch this shard holds
is summed (in micro-batch order), `reduce` adds the sums of the images other shards hold (a data-
parallel layer's peers, in plan order; nothing where this shard holds every image of its
channels), and every micro-batch goes on with the same totals. What it costs: a layer with a
BatchNorm cannot send micro-batch m's output before every micro-batch's conv is done, so its
micro-batches overlap the wire only after its last barrier.

Ghost batches (`ghost`, Page's trick for small-batch regularisation) cut the step's batch into
groups of that many consecutive images, each normalised with its own statistics, the running
statistics moving once per group in order: what PyTorch's BatchNorm2d does run on each group in
turn. Without them the whole batch is the one group, so both go the same way: a micro-batch's rows
fall into groups by their place in the batch, each group's sums are added over every piece of it
(micro-batches, workers), and a piece is normalised by its group's statistics.

Micro-batch outputs leave through `emit(m, y)` as soon as they are final, so the caller can send
them while the next one computes.
"""
import numpy as np

from hetconv.channelwise import (batch_statistics, batchnorm_parameter_grads, dropout2d_mask, eval_statistics,
                                 update_running_statistics)
from hetconv.devices.base import concatenate

# the context of an activation run inside the BatchNorm before it (Device.batchnorm_apply's
# `activation`): its backward is in that BatchNorm's, so the tail's backward skips it
FUSED = "fused into the BatchNorm before it"


class DropoutDraw:
    """Dropout2d masks drawn for the step's whole batch (images x every kernel of the layer) from
    (seed, step, layer, op) alone, so that any split into workers and micro-batches, and a replay
    of the step after a lost worker, drops the same channels. A shard takes its rows and kernels."""

    def __init__(self, seed, step, batch):
        self.seed, self.step, self.batch = int(seed), int(step), int(batch)
        self._drawn = {}

    def mask(self, layer, index, op, kernels, rows, channels):
        key = (layer, index)
        if key not in self._drawn:
            rng = np.random.default_rng([self.seed, self.step, 1 + layer, index])
            keep = rng.random((self.batch, kernels), dtype=np.float32) >= np.float32(op.p)
            self._drawn[key] = dropout2d_mask(op, keep)
        return np.ascontiguousarray(self._drawn[key][rows, channels])


def ghost_groups(batch, ghost):
    """How many statistics groups a step of `batch` images has: ceil(batch / ghost), or one."""
    return -(-batch // ghost) if ghost else 1


def statistics_segments(rows, batch, ghost):
    """The pieces of a micro-batch (its rows `rows`, a slice of the step's batch) by statistics
    group: [(group, first local row, end local row)]."""
    size = ghost or batch
    out, row = [], rows.start
    while row < rows.stop:
        group = row // size
        end = min(rows.stop, (group + 1) * size)
        out.append((group, row - rows.start, end - rows.start))
        row = end
    return out


def group_sums(per_segment, held, segments, groups, channels):
    """((groups, 2, C) float64 sums of per_segment(m, a, b) over every piece of each group, added in
    micro-batch and row order, zeros where this shard holds none of a group; and each group's count
    of values per channel here)."""
    sums, counts = np.zeros((groups, 2, channels)), np.zeros(groups, np.int64)
    for m in sorted(held):
        y = held[m]
        for group, a, b in segments[m]:
            sums[group] = sums[group] + np.stack(per_segment(m, a, b))
            counts[group] += (b - a) * y.shape[2] * y.shape[3]
    return sums, counts


def _join(pieces):
    return concatenate(pieces, axis=0)


class LayerChain:
    """The forward and backward of one layer slice (`sl`: spec, start, stop, w, b, host arrays,
    the per-micro-batch contexts and the gradients of the step) on `device`."""

    def __init__(self, device, sl, layer):
        self.device, self.sl, self.layer = device, sl, layer

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, inputs, train, reduce=None, emit=None, dropout=None, batch=None, ghost=0):
        """inputs: iterable of (micro-batch, x (n, C, H, W), first row of x in the step's batch of
        `batch` images). train: batch statistics and dropout, and what backward needs is kept;
        else evaluation (running statistics, no dropout, nothing kept). reduce(key, sums (G, 2, C)
        float64, counts (G,)) -> the sums and counts of every piece of each of the step's G
        statistics groups, at each BatchNorm. `ghost`: images per group (0: the whole batch).
        Returns {micro-batch: output} of those not emitted."""
        sl, dev = self.sl, self.device
        tail = sl.spec.tail
        barriers = [i for i, op in enumerate(tail) if train and op.type == "batchnorm"]
        first = barriers[0] if barriers else len(tail)
        held, rows, out = {}, {}, {}

        def done(m, y):
            if emit is None:
                out[m] = y
            else:
                emit(m, y)

        inputs = list(inputs) if batch is None else inputs
        if batch is None:                  # the pieces given are the whole batch
            batch = sum(len(x) for _, x, _ in inputs)
        groups, segments = ghost_groups(batch, ghost), {}
        if train:
            sl.groups = groups             # backward sums the same groups
        for m, x, row0 in inputs:
            if not len(x):                 # none of this micro-batch's images here (a data layer's share)
                if train:
                    sl.ctx[m] = x.shape
                done(m, np.zeros((0, sl.stop - sl.start) + sl.spec.output_hw(*x.shape[2:]), np.float32))
                continue
            # a conv without a bias is told so: its device need not sum dY for a db nobody trains
            y, ctx = dev.conv_block(sl.conv_input(x), sl.w, sl.b if sl.spec.bias else None, sl.block)
            ctxs = [ctx] + [None] * len(tail)
            rows[m] = slice(row0, row0 + len(x))
            segments[m] = statistics_segments(rows[m], batch, ghost)
            y = self._ops(0, first, y, ctxs, train, dropout, rows[m])
            if train:
                sl.ctx[m] = ctxs
            if barriers:
                held[m] = y
            else:
                done(m, y)
        for b, index in enumerate(barriers):
            bn = tail[index]
            sums, counts = group_sums(lambda m, a, b: dev.channel_sums(held[m][a:b]), held, segments, groups,
                                       sl.stop - sl.start)
            if reduce is not None:
                sums, counts = reduce(("bn_forward", index), sums, counts)
            stats = [batch_statistics(bn, s[0], s[1], int(n)) for s, n in zip(sums, counts)]
            for group in stats:            # one BatchNorm call per group, in order
                self._update_running(index, bn, group)
            end = barriers[b + 1] if b + 1 < len(barriers) else len(tail)
            weight, bias = self._affine(index, bn)
            act = self._fusable_activation(index, end)
            for m in sorted(held):
                pieces, ctx = [], []
                for group, a, c in segments[m]:
                    y, piece_ctx = dev.batchnorm_apply(held[m][a:c], stats[group].mean32, stats[group].invstd32,
                                                       weight, bias, activation=act)
                    pieces.append(y)
                    ctx.append((group, a, c, piece_ctx))
                sl.ctx[m][1 + index] = ctx
                if act is not None:
                    sl.ctx[m][2 + index] = FUSED
                held[m] = self._ops(index + 1 + (act is not None), end, _join(pieces), sl.ctx[m], train, dropout,
                                    rows[m])
        for m in sorted(held):
            done(m, held[m])
        return out

    def _fusable_activation(self, index, end):
        """The activation right after the BatchNorm at tail[index], where one runs before `end`
        (the next barrier): the device runs the two in one pass. Else None."""
        tail = self.sl.spec.tail
        return tail[index + 1] if index + 1 < end and tail[index + 1].type == "activation" else None

    def _ops(self, start, end, y, ctxs, train, dropout, rows):
        """Tail ops [start, end) on one micro-batch; their contexts into ctxs[1 + i]. A BatchNorm
        met here is in evaluation (training ones are barriers, never inside a run of ops), and
        runs the activation after it in the same pass."""
        sl, dev = self.sl, self.device
        fused = None
        for i in range(start, end):
            op = sl.spec.tail[i]
            kind = op.type
            if i == fused:
                ctxs[1 + i] = None
                continue
            if kind == "activation":
                y, ctxs[1 + i] = dev.activation(y, op)
            elif kind in ("pool", "global_pool"):
                y, ctxs[1 + i] = dev.pool(y, op)
            elif kind == "batchnorm":
                mean, invstd = eval_statistics(op, sl.host[f"bn{i}.running_mean"], sl.host[f"bn{i}.running_var"])
                weight, bias = self._affine(i, op)
                act = self._fusable_activation(i, end)
                fused = i + 1 if act is not None else None
                y, _ = dev.batchnorm_apply(y, mean, invstd, weight, bias, activation=act)
            elif kind == "dropout2d":
                if train and op.p > 0:
                    mask = dropout.mask(self.layer, i, op, sl.spec.kernels, rows, slice(sl.start, sl.stop))
                    y = dev.channel_scale(y, mask)
                    ctxs[1 + i] = mask
            else:
                raise ValueError(f"layer {self.layer}: tail op {i} is {kind!r}, which a shard does not run")
            if not train:
                ctxs[1 + i] = None
        return y

    def _affine(self, index, bn):
        if not bn.affine:
            return None, None
        return self.sl.host[f"bn{index}.weight"], self.sl.host[f"bn{index}.bias"]

    def _update_running(self, index, bn, stats):
        host, name = self.sl.host, f"bn{index}"
        mean, var, tracked = update_running_statistics(bn, host[f"{name}.running_mean"], host[f"{name}.running_var"],
                                                       int(host[f"{name}.num_batches_tracked"]), stats)
        host[f"{name}.running_mean"][...] = mean
        host[f"{name}.running_var"][...] = var
        host[f"{name}.num_batches_tracked"][...] = tracked

    # ---- backward --------------------------------------------------------------------------------
    def backward(self, grads, need_dx, reduce=None, emit=None):
        """grads: iterable of (micro-batch, dL/d(output)). The conv's dW and db add up over the
        micro-batches in the slice's step sums, each BatchNorm's weight and bias gradients are the
        whole batch's (after `reduce`, as in forward). Returns {micro-batch: dx} of those not
        emitted (dx None where not needed)."""
        sl, dev = self.sl, self.device
        tail = sl.spec.tail
        barriers = [i for i, op in enumerate(tail) if op.type == "batchnorm"]
        last = barriers[-1] if barriers else -1
        held, out = {}, {}
        for m, g in grads:
            ctxs = sl.ctx.get(m)
            if ctxs is None:
                raise ValueError(f"layer {self.layer}: backward of micro-batch {m} without a forward to match "
                                 f"(waiting: {sorted(sl.ctx)})")
            if isinstance(ctxs, tuple):    # no images of it here: the input's shape, kept by forward
                del sl.ctx[m]
                dx = np.zeros(ctxs, np.float32) if need_dx else None
                if emit is None:
                    out[m] = dx
                else:
                    emit(m, dx)
                continue
            g = self._ops_backward(len(tail), last + 1, g, ctxs)
            if barriers:
                held[m] = g
            else:
                self._conv_backward(m, g, need_dx, emit, out)
        for b in reversed(range(len(barriers))):
            index = barriers[b]
            bn = tail[index]
            ctxs = {m: sl.ctx[m] for m in held}
            segments = {m: [(group, a, c) for group, a, c, _ in ctxs[m][1 + index]] for m in held}
            piece_ctx = {(m, a): ctx for m in held for _, a, _, ctx in ctxs[m][1 + index]}
            sums, counts = group_sums(lambda m, a, c: dev.batchnorm_grad_sums(piece_ctx[m, a], held[m][a:c]), held,
                                       segments, sl.groups, sl.stop - sl.start)
            if reduce is not None:
                sums, counts = reduce(("bn_backward", index), sums, counts)
            if bn.affine:                  # the weight's and bias's gradients: every group's, in order
                dweight, dbias = batchnorm_parameter_grads(sums[:, 0].sum(axis=0), sums[:, 1].sum(axis=0))
                self._add_host_grad(f"bn{index}.weight", dweight)
                self._add_host_grad(f"bn{index}.bias", dbias)
            start = barriers[b - 1] + 1 if b > 0 else 0
            for m in sorted(held):
                g = _join([dev.batchnorm_backward(piece_ctx[m, a], held[m][a:c], sums[group, 0], sums[group, 1],
                                                  int(counts[group])) for group, a, c in segments[m]])
                held[m] = self._ops_backward(index, start, g, ctxs[m])
        for m in sorted(held):
            self._conv_backward(m, held[m], need_dx, emit, out)
        return out

    def _ops_backward(self, end, start, g, ctxs):
        """Back through tail ops [start, end), last first."""
        dev = self.device
        for i in reversed(range(start, end)):
            op, ctx = self.sl.spec.tail[i], ctxs[1 + i]
            if ctx is FUSED:
                continue
            if op.type == "activation":
                g = dev.activation_backward(ctx, g)
            elif op.type in ("pool", "global_pool"):
                g = dev.pool_backward(ctx, g)
            elif op.type == "dropout2d" and ctx is not None:
                g = dev.channel_scale(g, ctx)
        return g

    def _add_host_grad(self, name, g):
        grads = self.sl.host_grads
        grads[name] = g if name not in grads else grads[name] + g

    def _conv_backward(self, m, g, need_dx, emit, out):
        sl = self.sl
        ctxs = sl.ctx.pop(m)               # frees the saved input: the largest buffer a slice holds
        first = sl.dw is None
        # an emitted dX leaves as soon as the device has it, on a path that computes it before dW
        on_dx = None if emit is None or not need_dx else (lambda dx: emit(m, sl.whole_dx(dx)))
        dx, dw, db = self.device.conv_block_backward(ctxs[0], sl.w, g, need_dx,
                                                     dw_out=sl.dw_kept if first else sl.dw, accumulate=not first,
                                                     on_dx=on_dx)
        if first:
            sl.dw, sl.db, sl.dw_kept = dw, db, None
        else:
            self.device.accumulate_(sl.db, db)
        if emit is None:
            out[m] = sl.whole_dx(dx)
        elif on_dx is None:
            emit(m, sl.whole_dx(dx))
