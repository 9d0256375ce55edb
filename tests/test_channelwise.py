"""The per-channel layer descriptors: checked values, their JSON form, output sizes; and the host-side
BatchNorm and Dropout2d helpers."""
import numpy as np
import pytest

from hetconv import channelwise as cw

LAYERS = [
    cw.Activation("relu"), cw.Activation("gelu", approximate="tanh"), cw.Activation("gelu"),
    cw.Activation("leaky_relu", negative_slope=0.2), cw.Activation("elu", alpha=0.5), cw.Activation("celu", alpha=2),
    cw.Activation("hardswish"), cw.Activation("relu6"), cw.Activation("hardtanh", min_val=-2, max_val=0.5),
    cw.Activation("hardsigmoid"), cw.Pool("max", 3, stride=2, padding=1), cw.Pool("avg", (2, 3)),
    cw.GlobalPool("avg"), cw.GlobalPool("max"), cw.BatchNorm(), cw.BatchNorm(eps=1e-3, momentum=None, affine=False),
    cw.Dropout2d(0.25), cw.Dropout2d(0),
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: str(l.to_json()))
def test_json_round_trip(layer):
    d = layer.to_json()
    assert cw.layer_from_json(d) == layer
    assert type(layer).from_json({k: v for k, v in d.items() if k != "type"}) == layer


def test_only_the_keys_an_activation_uses_are_stored():
    assert cw.Activation("relu").to_json() == {"type": "activation", "kind": "relu"}
    assert cw.Activation("leaky_relu").to_json() == {"type": "activation", "kind": "leaky_relu", "negative_slope": 0.01}
    assert cw.Activation("gelu").to_json() == {"type": "activation", "kind": "gelu", "approximate": "none"}
    assert cw.Activation("celu", alpha=3).to_json() == {"type": "activation", "kind": "celu", "alpha": 3.0}
    assert cw.Activation("hardtanh").to_json() == {"type": "activation", "kind": "hardtanh", "min_val": -1.0,
                                                   "max_val": 1.0}
    assert cw.Activation("relu6").to_json() == {"type": "activation", "kind": "relu6"}


@pytest.mark.parametrize("make,message", [
    (lambda: cw.Activation("swish"), r"activation kind must be one of .* got 'swish'"),
    (lambda: cw.Activation("relu", alpha=2.0), r"activation relu takes no parameters, not alpha=2.0"),
    (lambda: cw.Activation("elu", negative_slope=0.1), r"activation elu takes alpha, not negative_slope=0.1"),
    (lambda: cw.Activation("silu", approximate="tanh"), r"activation silu takes no parameters, not approximate='tanh'"),
    (lambda: cw.Activation("gelu", approximate="fast"), r"gelu approximate must be one of \('none', 'tanh'\), got 'fast'"),
    (lambda: cw.Activation("celu", alpha=0), r"activation celu alpha must be a finite nonzero number, got 0"),
    (lambda: cw.Activation("leaky_relu", negative_slope=float("nan")), r"negative_slope must be a finite number, got nan"),
    (lambda: cw.Activation("elu", alpha=True), r"alpha must be a finite number, got True"),
    (lambda: cw.Activation("relu6", max_val=5.0), r"activation relu6 takes no parameters, not max_val=5.0"),
    (lambda: cw.Activation("hardtanh", min_val=2, max_val=1),
     r"hardtanh max_val must be greater than min_val, got min_val 2.0 and max_val 1.0"),
    (lambda: cw.Activation("hardtanh", max_val=float("inf")), r"hardtanh max_val must be a finite number, got inf"),
    (lambda: cw.Pool("min", 2), r"pool mode must be one of \('max', 'avg'\), got 'min'"),
    (lambda: cw.Pool("max", 0), r"pool kernel must be a positive integer"),
    (lambda: cw.Pool("max", 2, stride=(1, 0)), r"pool stride must be a positive integer"),
    (lambda: cw.Pool("avg", 3, padding=2), r"pool padding \(2, 2\) must be at most half of the kernel \(3, 3\)"),
    (lambda: cw.GlobalPool("sum"), r"global pool mode must be one of \('max', 'avg'\), got 'sum'"),
    (lambda: cw.BatchNorm(eps=0), r"batchnorm eps must be a finite number > 0, got 0"),
    (lambda: cw.BatchNorm(momentum=1.5), r"batchnorm momentum must be a number in \[0, 1\] or None, got 1.5"),
    (lambda: cw.BatchNorm(affine=1), r"batchnorm affine must be true or false, got 1"),
    (lambda: cw.Dropout2d(1.0), r"dropout2d p must be a number in \[0, 1\), got 1.0"),
])
def test_bad_values_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("d,message", [
    ({"type": "activation", "kind": "relu", "alpha": 1.0}, r"unknown activation relu key\(s\) \['alpha'\]"),
    ({"type": "activation"}, r"activation needs a kind"),
    ({"type": "pool", "mode": "max", "kernel": 2, "dilation": 2}, r"unknown pool key\(s\) \['dilation'\]"),
    ({"type": "pool", "mode": "max"}, r"pool needs a kernel"),
    ({"type": "batchnorm", "track_running_stats": False}, r"unknown batchnorm key\(s\) \['track_running_stats'\]"),
    ({"type": "dropout2d", "p": 0.1, "inplace": True}, r"unknown dropout2d key\(s\) \['inplace'\]"),
    ({"type": "layernorm"}, r"a per-channel layer needs a type, one of .* got 'layernorm'"),
    ([1, 2], r"a per-channel layer needs a type"),
])
def test_bad_json_is_refused(d, message):
    with pytest.raises(ValueError, match=message):
        cw.layer_from_json(d)


def test_a_descriptor_refuses_another_layers_json():
    with pytest.raises(ValueError, match=r"pool type must be 'pool', got 'global_pool'"):
        cw.Pool.from_json({"type": "global_pool", "mode": "max"})


def test_output_sizes():
    assert cw.Pool("max", 2).output_hw(7, 6) == (3, 3)                  # floor mode
    assert cw.Pool("max", 3, stride=2, padding=1).output_hw(28, 28) == (14, 14)
    assert cw.Pool("avg", (3, 1), stride=(1, 1)).output_hw(5, 4) == (3, 4)
    assert cw.GlobalPool("avg").output_hw(9, 3) == (1, 1)
    for layer in (cw.Activation("silu"), cw.BatchNorm(), cw.Dropout2d()):
        assert layer.output_hw(9, 3) == (9, 3)
    with pytest.raises(ValueError, match=r"a 2x5 input is too small for a 3x3 max-pool with padding \(0, 0\)"):
        cw.Pool("max", 3).output_hw(2, 5)


# ---- host-side helpers ----------------------------------------------------------------------------

def test_batch_statistics_from_sums():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 2)) * 3 + 7
    bn = cw.BatchNorm(eps=1e-3)
    stats = cw.batch_statistics(bn, x.sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3)), 40)
    np.testing.assert_allclose(stats.mean, x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(stats.var, x.var(axis=(0, 2, 3)), rtol=1e-10)
    np.testing.assert_allclose(stats.invstd, 1 / np.sqrt(x.var(axis=(0, 2, 3)) + 1e-3), rtol=1e-10)
    assert stats.mean32.dtype == stats.invstd32.dtype == np.float32


def test_a_constant_channel_has_no_negative_variance():
    x = np.full(3, 0.1)         # float64 rounding leaves ss/n - mean^2 at -1.7e-18
    s, ss = np.array([x.sum()]), np.array([(x * x).sum()])
    assert ss[0] / 3 - (s[0] / 3) ** 2 < 0
    assert cw.batch_statistics(cw.BatchNorm(), s, ss, 3).var[0] == 0


@pytest.mark.parametrize("count", [1, 0, 2.0, True])
def test_statistics_need_more_than_one_value_per_channel(count):
    with pytest.raises(ValueError, match="more than one value per channel"):
        cw.batch_statistics(cw.BatchNorm(), np.zeros(2), np.zeros(2), count)


def test_statistics_name_a_mis_shaped_sum():
    with pytest.raises(ValueError, match=r"ss must have shape \(3,\), got \(2,\)"):
        cw.batch_statistics(cw.BatchNorm(), np.zeros(3), np.zeros(2), 10)


def test_running_statistics_momentum_and_cumulative():
    stats = cw.BatchStatistics(mean=np.array([1.0, 2.0]), var=np.array([3.0, 4.0]), invstd=np.ones(2), count=4)
    mean, var, tracked = cw.update_running_statistics(cw.BatchNorm(momentum=0.25), np.zeros(2), np.ones(2), 5, stats)
    np.testing.assert_allclose(mean, [0.25, 0.5])
    np.testing.assert_allclose(var, [0.75 + 0.25 * 4.0, 0.75 + 0.25 * 16 / 3])     # unbiased: x 4/3
    assert tracked == 6 and mean.dtype == var.dtype == np.float32
    # momentum None: the batch weighs 1/(batches so far), so the first batch replaces the start
    mean, var, tracked = cw.update_running_statistics(cw.BatchNorm(momentum=None), np.full(2, 9.0), np.ones(2), 0, stats)
    np.testing.assert_allclose(mean, [1.0, 2.0])
    np.testing.assert_allclose(var, [4.0, 16 / 3])
    mean, _, tracked = cw.update_running_statistics(cw.BatchNorm(momentum=None), mean, var, tracked, stats)
    assert tracked == 2
    np.testing.assert_allclose(mean, [1.0, 2.0])


def test_eval_statistics_and_parameter_gradients():
    mean, invstd = cw.eval_statistics(cw.BatchNorm(eps=0.5), np.array([1.0, -2.0]), np.array([1.5, 3.5]))
    np.testing.assert_allclose(invstd, [0.5 ** 0.5, 0.5])
    assert mean.dtype == invstd.dtype == np.float32
    dweight, dbias = cw.batchnorm_parameter_grads(np.array([1.0, 2.0]), np.array([3.0, 4.0]))
    assert dweight.tolist() == [3.0, 4.0] and dbias.tolist() == [1.0, 2.0]


def test_dropout2d_mask():
    keep = np.array([[True, False, True], [False, False, True]])
    mask = cw.dropout2d_mask(cw.Dropout2d(0.2), keep)
    assert mask.dtype == np.float32
    np.testing.assert_array_equal(mask, np.where(keep, np.float32(1.25), 0))
    with pytest.raises(ValueError, match=r"keep must be an \(N, C\) bool array, got int64 of shape \(2, 3\)"):
        cw.dropout2d_mask(cw.Dropout2d(0.2), keep.astype(np.int64))
