"""The per-channel layers on a device against the float64 reference: what the CPU and the CUDA
device tests share (each passes its device and shapes small enough for it)."""
import numpy as np

from hetconv import channelwise as cw
from hetconv.net import reference_channelwise as R

ACTIVATIONS = [
    cw.Activation("relu"), cw.Activation("gelu"), cw.Activation("gelu", approximate="tanh"), cw.Activation("silu"),
    cw.Activation("leaky_relu", negative_slope=0.2), cw.Activation("elu", alpha=0.7), cw.Activation("celu", alpha=1.8),
    cw.Activation("tanh"), cw.Activation("sigmoid"), cw.Activation("hardswish"), cw.Activation("identity"),
    cw.Activation("relu6"), cw.Activation("hardtanh", min_val=-2.5, max_val=0.5), cw.Activation("hardsigmoid"),
]

POOLS = [
    cw.Pool("max", 2), cw.Pool("max", 3, stride=2, padding=1), cw.Pool("max", (3, 2), stride=(1, 2)),
    cw.Pool("avg", 2), cw.Pool("avg", 3, stride=2, padding=1), cw.Pool("avg", (2, 3), stride=1, padding=1),
    cw.GlobalPool("avg"), cw.GlobalPool("max"),
]


def close(got, expected, what=""):
    """Within 1e-4 relative to the expected values' magnitude."""
    expected = np.asarray(expected, np.float64)
    scale = float(np.abs(expected).max()) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-4, atol=1e-4 * scale + 1e-30,
                               err_msg=what)


def f32(rng, *shape, scale=1.0, shift=0.0):
    return (scale * rng.standard_normal(shape) + shift).astype(np.float32)


def check_activation(dev, act, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = f32(rng, *shape, scale=3)
    x.flat[:7] = [0.0, -3.0, 3.0, -30.0, 30.0, 6.0, -2.5]     # the kinks and saturation
    dy = f32(rng, *shape)
    y, ctx = dev.activation(x, act)
    assert y.dtype == np.float32 and y.shape == x.shape
    close(y, R.activation(x, act), f"{act} forward")
    dx = dev.activation_backward(ctx, dy)
    assert dx.dtype == np.float32 and dx.shape == x.shape
    close(dx, R.activation_backward(x, dy, act), f"{act} backward")


def check_pool(dev, pool, shape, ties, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, shape).astype(np.float32) if ties else f32(rng, *shape)
    y, ctx = dev.pool(x, pool)
    expected = R.pool(x, pool)
    assert y.shape == expected.shape and y.dtype == np.float32
    close(y, expected, f"{pool} forward")
    dy = f32(rng, *y.shape)
    dx = dev.pool_backward(ctx, dy)
    assert dx.shape == x.shape and dx.dtype == np.float32
    close(dx, R.pool_backward(x, dy, pool), f"{pool} backward")


# ---- BatchNorm: a batch held in pieces, on one device or on several ---------------------------------

def batchnorm_inputs(shape, seed=0):
    """x with channels of different means and spreads, dy, weight, bias."""
    rng = np.random.default_rng(seed)
    n, c, h, w = shape
    x = (rng.standard_normal(shape) * rng.uniform(0.5, 3, c)[None, :, None, None]
         + rng.uniform(-4, 4, c)[None, :, None, None]).astype(np.float32)
    return x, f32(rng, *shape), f32(rng, c, scale=0.5, shift=1), f32(rng, c)


def batchnorm_step(devices_and_pieces, bn, weight, bias):
    """One training step of BatchNorm over a batch held as (device, x piece, dy piece) pieces: each
    piece's sums, added on the host in order; the statistics; each piece normalised; the gradient
    sums, added; each piece's dx. Returns (y pieces, dx pieces, stats, (sdy, sdyx))."""
    count = sum(x.shape[0] * x.shape[2] * x.shape[3] for _, x, _ in devices_and_pieces)
    s = ss = 0
    for dev, x, _ in devices_and_pieces:
        ps, pss = dev.channel_sums(x)
        assert ps.dtype == pss.dtype == np.float64
        s, ss = s + ps, ss + pss
    stats = cw.batch_statistics(bn, s, ss, count)
    w, b = (weight, bias) if bn.affine else (None, None)
    applied = [dev.batchnorm_apply(x, stats.mean32, stats.invstd32, w, b) for dev, x, _ in devices_and_pieces]
    sdy = sdyx = 0
    for (dev, _, dy), (_, ctx) in zip(devices_and_pieces, applied):
        a, b_ = dev.batchnorm_grad_sums(ctx, dy)
        sdy, sdyx = sdy + a, sdyx + b_
    dxs = [dev.batchnorm_backward(ctx, dy, sdy, sdyx, count)
           for (dev, _, dy), (_, ctx) in zip(devices_and_pieces, applied)]
    return [y for y, _ in applied], dxs, stats, (sdy, sdyx)


def check_batchnorm_against_reference(pieces, bn, x, dy, weight, bias):
    """`pieces`: (device, image slice) covering x's batch in order."""
    ys, dxs, stats, (sdy, sdyx) = batchnorm_step([(dev, x[sl], dy[sl]) for dev, sl in pieces], bn, weight, bias)
    c = x.shape[1]
    running = (np.zeros(c, np.float32), np.ones(c, np.float32), 0)
    y_ref, running_ref = R.batchnorm_train(x, bn, weight, bias, *running)
    close(np.concatenate(ys), y_ref, "batchnorm forward")
    dx_ref, dweight_ref, dbias_ref = R.batchnorm_train_backward(x, dy, bn, weight)
    close(np.concatenate(dxs), dx_ref, "batchnorm dx")
    if bn.affine:
        dweight, dbias = cw.batchnorm_parameter_grads(sdy, sdyx)
        close(dweight, dweight_ref, "batchnorm dweight")
        close(dbias, dbias_ref, "batchnorm dbias")
    mean, var, tracked = cw.update_running_statistics(bn, *running, stats)
    close(mean, running_ref[0], "running mean")
    close(var, running_ref[1], "running var")
    assert tracked == running_ref[2] == 1
    return stats, (sdy, sdyx)


def check_batchnorm_eval(dev, bn, shape, seed=0):
    x, dy, weight, bias = batchnorm_inputs(shape, seed)
    rng = np.random.default_rng(seed + 1)
    c = shape[1]
    running_mean, running_var = f32(rng, c), rng.uniform(0.5, 2, c).astype(np.float32)
    mean, invstd = cw.eval_statistics(bn, running_mean, running_var)
    w, b = (weight, bias) if bn.affine else (None, None)
    y, ctx = dev.batchnorm_apply(x, mean, invstd, w, b)
    close(y, R.batchnorm_eval(x, bn, weight, bias, running_mean, running_var), "batchnorm eval forward")
    dx = dev.batchnorm_backward(ctx, dy, np.zeros(c), np.zeros(c), 1)
    close(dx, R.batchnorm_eval_backward(dy, bn, weight, running_var), "batchnorm eval backward")


def check_channel_scale(dev, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = f32(rng, *shape)
    mask = cw.dropout2d_mask(cw.Dropout2d(0.4), rng.random(shape[:2]) < 0.6)
    y = dev.channel_scale(x, mask)
    assert y.dtype == np.float32 and y is not x
    close(y, R.dropout2d(x, mask), "channel_scale")


def check_a_piece_with_no_images(dev):
    """A worker or micro-batch may hold no images of a batch: every call returns empty arrays
    and zero sums."""
    x = np.zeros((0, 3, 4, 4), np.float32)
    y, ctx = dev.activation(x, cw.Activation("gelu"))
    assert y.shape == x.shape and dev.activation_backward(ctx, x).shape == x.shape
    y, ctx = dev.pool(x, cw.Pool("max", 2))
    assert y.shape == (0, 3, 2, 2) and dev.pool_backward(ctx, y).shape == x.shape
    s, ss = dev.channel_sums(x)
    assert s.tolist() == ss.tolist() == [0, 0, 0]
    ones = np.ones(3, np.float32)
    y, ctx = dev.batchnorm_apply(x, ones, ones, ones, ones)
    sdy, sdyx = dev.batchnorm_grad_sums(ctx, x)
    assert y.shape == x.shape and sdy.tolist() == sdyx.tolist() == [0, 0, 0]
    assert dev.batchnorm_backward(ctx, x, ones, ones, 10).shape == x.shape
    assert dev.channel_scale(x, np.zeros((0, 3), np.float32)).shape == x.shape
