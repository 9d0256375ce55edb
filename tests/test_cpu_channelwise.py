"""The CPU device's per-channel layers against the float64 reference, BatchNorm over a batch held
in pieces, and the checks of the device contract's per-channel methods."""
import numpy as np
import pytest

from hetconv import channelwise as cw
from hetconv.devices import open_device

import _channelwise_cases as cases

SHAPES = [(2, 3, 5, 4), (3, 5, 9, 7)]


@pytest.fixture(scope="module")
def dev():
    return open_device("cpu", threads=2)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("act", cases.ACTIVATIONS, ids=lambda a: str(a.to_json()))
def test_activation_matches_reference(dev, act, shape):
    cases.check_activation(dev, act, shape)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("pool", cases.POOLS, ids=lambda p: str(p.to_json()))
def test_pool_matches_reference(dev, pool, ties):
    cases.check_pool(dev, pool, (2, 3, 7, 8), ties)


BATCHNORMS = [cw.BatchNorm(), cw.BatchNorm(eps=1e-3, momentum=None), cw.BatchNorm(affine=False)]


@pytest.mark.parametrize("bn", BATCHNORMS, ids=lambda b: str(b.to_json()))
def test_batchnorm_whole_batch_matches_reference(dev, bn):
    x, dy, weight, bias = cases.batchnorm_inputs((4, 5, 6, 3))
    cases.check_batchnorm_against_reference([(dev, slice(None))], bn, x, dy, weight, bias)


@pytest.mark.parametrize("cuts", [(2,), (1, 3), (1, 2, 4)], ids=str)
def test_batchnorm_in_pieces_equals_the_whole_batch(dev, cuts):
    """Micro-batches: the pieces' sums, added on the host, are the whole batch's (to float64
    rounding), and so is every output and gradient."""
    bn = cw.BatchNorm()
    x, dy, weight, bias = cases.batchnorm_inputs((5, 4, 6, 5), seed=1)
    bounds = (0, *cuts, len(x))
    pieces = [(dev, slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    stats, sums = cases.check_batchnorm_against_reference(pieces, bn, x, dy, weight, bias)
    whole_stats, whole_sums = cases.check_batchnorm_against_reference([(dev, slice(None))], bn, x, dy, weight, bias)
    np.testing.assert_allclose(stats.mean, whole_stats.mean, rtol=1e-12)
    np.testing.assert_allclose(stats.var, whole_stats.var, rtol=1e-12)
    for a, b in zip(sums, whole_sums):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(b).max())


def test_batchnorm_two_workers_each_holding_some_images():
    bn = cw.BatchNorm(momentum=0.2)
    x, dy, weight, bias = cases.batchnorm_inputs((5, 3, 4, 4), seed=2)
    first, second = open_device("cpu", threads=1), open_device("cpu", threads=2)
    cases.check_batchnorm_against_reference([(first, slice(0, 2)), (second, slice(2, 5))], bn, x, dy, weight, bias)


def test_channel_sums_do_not_depend_on_the_thread_count():
    x, _, _, _ = cases.batchnorm_inputs((6, 5, 7, 7), seed=3)
    one = open_device("cpu", threads=1).channel_sums(x)
    two = open_device("cpu", threads=2).channel_sums(x)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(one[0], x64.sum(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(one[1], (x64 * x64).sum(axis=(0, 2, 3)), rtol=1e-12)


@pytest.mark.parametrize("bn", [cw.BatchNorm(), cw.BatchNorm(affine=False)], ids=["affine", "plain"])
def test_batchnorm_evaluation_matches_reference(dev, bn):
    cases.check_batchnorm_eval(dev, bn, (3, 4, 5, 2))


def test_channel_scale_matches_reference(dev):
    cases.check_channel_scale(dev, (3, 4, 5, 6))


# ---- the contract's checks ----------------------------------------------------------------------------

def test_bad_inputs_are_named(dev):
    x = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(TypeError, match="x must be float32, got float64"):
        dev.activation(x.astype(np.float64), cw.Activation("relu"))
    with pytest.raises(TypeError, match="act must be an Activation, got str"):
        dev.activation(x, "relu")
    with pytest.raises(TypeError, match="pool must be a Pool or a GlobalPool, got Activation"):
        dev.pool(x, cw.Activation("relu"))
    with pytest.raises(ValueError, match=r"a 4x4 input is too small for a 5x5 max-pool"):
        dev.pool(x, cw.Pool("max", 5))
    y, ctx = dev.pool(x, cw.Pool("max", 2))
    with pytest.raises(ValueError, match=r"dy shape must match the pool output, \(2, 3, 4, 4\) != \(2, 3, 2, 2\)"):
        dev.pool_backward(ctx, x)
    with pytest.raises(TypeError, match="ctx must be what activation\\(\\) returned, got 'pool'"):
        dev.activation_backward(ctx, y)
    ones = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"invstd must have one value per channel, \(2,\) != \(3,\)"):
        dev.batchnorm_apply(x, ones, ones[:2], None, None)
    with pytest.raises(TypeError, match="mean must be float32, got float64"):
        dev.batchnorm_apply(x, ones.astype(np.float64), ones, None, None)
    with pytest.raises(ValueError, match="weight and bias must both be given .* got weight an array and bias None"):
        dev.batchnorm_apply(x, ones, ones, ones, None)
    _, ctx = dev.batchnorm_apply(x, ones, ones, None, None)
    with pytest.raises(ValueError, match=r"count must be a positive integer .* got 0"):
        dev.batchnorm_backward(ctx, x, np.zeros(3), np.zeros(3), 0)
    with pytest.raises(ValueError, match=r"sdyx must have one value per channel, \(4,\) != \(3,\)"):
        dev.batchnorm_backward(ctx, x, np.zeros(3), np.zeros(4), 10)
    with pytest.raises(ValueError, match=r"mask must have one value per \(image, channel\), \(3, 2\) != \(2, 3\)"):
        dev.channel_scale(x, np.ones((3, 2), np.float32))


def test_the_written_out_exp_is_within_float32_rounding():
    """activation_math.exp (what every exp-based activation uses on both devices): within 1e-7
    relative over the whole normal range, held at the ends, NaN kept."""
    import numba
    from hetconv.devices import activation_math as am

    @numba.njit
    def exps(x, y):
        for i in range(x.shape[0]):
            y[i] = am.exp(x[i])

    x = np.linspace(-87, 88, 100_001).astype(np.float32)
    y = np.empty_like(x)
    exps(x, y)
    expected = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - expected) / expected) < 1e-7
    ends = np.empty(3, np.float32)
    exps(np.array([-1e30, 1e30, np.nan], np.float32), ends)
    assert ends[0] == pytest.approx(2.0 ** -126, rel=1e-5) and ends[1] == pytest.approx(np.exp(88.0), rel=1e-7)
    assert np.isnan(ends[2])


def test_a_piece_with_no_images(dev):
    cases.check_a_piece_with_no_images(dev)
