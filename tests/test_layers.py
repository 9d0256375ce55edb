import numpy as np
import pytest

from hetconv.devices.cpu import head_gemm as gemm
from hetconv.net.layers import Linear, relu, relu_backward, softmax_cross_entropy
from hetconv.params import sgd_update


def test_linear_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    fc = Linear.init(7, 5, rng)
    x = rng.standard_normal((4, 7)).astype(np.float32)
    dy = rng.standard_normal((4, 5)).astype(np.float64)
    fc.forward(x)
    dx = fc.backward(dy.astype(np.float32))
    v = rng.standard_normal(x.shape).astype(np.float32)
    numeric = (np.sum(dy * (fc.forward(x + v) @ np.eye(5))) - np.sum(dy * fc.forward(x - v))) / 2
    assert numeric == pytest.approx(float(np.sum(dx * v)), rel=1e-4)
    fc.forward(x)
    fc.backward(dy.astype(np.float32))
    vw = rng.standard_normal(fc.w.shape).astype(np.float32)
    w0 = fc.w.copy()
    fc.w = w0 + vw
    lp = np.sum(dy * fc.forward(x))
    fc.w = w0 - vw
    lm = np.sum(dy * fc.forward(x))
    assert (lp - lm) / 2 == pytest.approx(float(np.sum(fc.dw * vw)), rel=1e-4)
    np.testing.assert_allclose(fc.db, dy.sum(axis=0), rtol=1e-5)


def test_head_gemm_matches_numpy_on_every_layout_the_head_uses():
    """oneDNN's sgemm where installed, numpy's matmul otherwise: the same products (to float32
    rounding) on row-major operands and transposed views, written or added into `out`; another
    dtype goes to numpy."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 9)).astype(np.float32)
    w = rng.standard_normal((5, 9)).astype(np.float32)
    dy = rng.standard_normal((6, 5)).astype(np.float32)
    for a, b in ((x, w.T), (dy.T, x), (dy, w)):
        want = a.astype(np.float64) @ b
        np.testing.assert_allclose(gemm(a, b), want, rtol=1e-5, atol=1e-5)
        out = np.ones(want.shape, np.float32)
        assert gemm(a, b, out=out, accumulate=True) is out
        np.testing.assert_allclose(out, want + 1, rtol=1e-5, atol=1e-5)
        gemm(a, b, out=out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    broadcast = np.broadcast_to(x[:1], x.shape)                 # no GEMM takes it as it is
    np.testing.assert_allclose(gemm(broadcast, w.T), broadcast.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    got = gemm(x.astype(np.float64), w.T.astype(np.float64))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-6)
    fc = Linear(w, np.zeros(5, np.float32), gemm=gemm)     # a later micro-batch's gradients add up
    fc.forward(x[:3])
    fc.backward(dy[:3])
    fc.forward(x[3:])
    fc.backward(dy[3:], accumulate=True)
    np.testing.assert_allclose(fc.dw, dy.T.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)


def test_weight_gradients_left_due_are_the_same_bits_once_settled():
    """backward(weights_later=True) returns the input's gradient with dw and db still due; settle()
    (or params(), which an update and the gradients' norm read) computes them: the same bits as at
    once, and over micro-batches they add up in the same order. A due left by a step abandoned
    before its update, or by a reload, is dropped, never added to the next step's."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((5, 9)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    xs = [rng.standard_normal((3, 9)).astype(np.float32) for _ in range(3)]
    dys = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(3)]
    now, later = Linear(w, b, gemm=gemm), Linear(w, b, gemm=gemm)
    for m, (x, dy) in enumerate(zip(xs, dys)):
        now.forward(x)
        later.forward(x)
        dx_now = now.backward(dy, accumulate=m > 0)
        dx_later = later.backward(dy, accumulate=m > 0, weights_later=True)
        assert np.array_equal(dx_now, dx_later)
        if m == 0:
            assert later.dw is None                           # nothing computed yet
            later.settle()
            assert np.array_equal(later.dw, now.dw)
            later.settle()                                    # nothing left: a second call changes nothing
    assert later.dw is not None and not np.array_equal(later.dw, now.dw)   # the last micro-batch still due
    for (_, _, _, got), (_, _, _, want) in zip(later.params(), now.params()):
        assert np.array_equal(got, want)
    np.testing.assert_allclose(now.dw, sum(dy.T.astype(np.float64) @ x for x, dy in zip(xs, dys)),
                               rtol=1e-5, atol=1e-5)

    abandoned = Linear(w, b, gemm=gemm)
    abandoned.forward(xs[1])
    abandoned.backward(dys[1], weights_later=True)            # its step ends before any update
    abandoned.forward(xs[0])
    abandoned.backward(dys[0])                                # the next step's first micro-batch
    fresh = Linear(w, b, gemm=gemm)
    fresh.forward(xs[0])
    fresh.backward(dys[0])
    assert np.array_equal(abandoned.dw, fresh.dw) and np.array_equal(abandoned.db, fresh.db)
    reloaded = Linear(w, b, gemm=gemm)
    reloaded.forward(xs[1])
    reloaded.backward(dys[1], weights_later=True)
    reloaded.load_state({"w": w, "b": b})
    reloaded.settle()
    assert reloaded.dw is None


def test_softmax_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 10))
    labels = rng.integers(0, 10, 6)
    loss, grad = softmax_cross_entropy(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert loss == pytest.approx(-np.mean(np.log(p[np.arange(6), labels])))
    eps = 1e-5
    v = rng.standard_normal(logits.shape)
    numeric = (softmax_cross_entropy(logits + eps * v, labels)[0] - softmax_cross_entropy(logits - eps * v, labels)[0]) / (2 * eps)
    assert numeric == pytest.approx(float(np.sum(grad * v)), rel=1e-4)


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    loss, grad = softmax_cross_entropy(np.array([[1e4, 0.0, -1e4]]), np.array([0]))
    assert loss == pytest.approx(0.0) and np.all(np.isfinite(grad))


def test_relu_backward_passes_only_where_active():
    x = np.array([[-1.0, 0.0, 2.0]], np.float32)
    assert relu_backward(relu(x), np.ones_like(x)).tolist() == [[0, 0, 1]]


def test_sgd_matches_pytorch_rule():
    p, v, g = np.array([1.0, -2.0], np.float32), np.array([0.5, 0.5], np.float32), np.array([0.1, 0.2], np.float32)
    expected_v = 0.9 * v + g + 0.01 * p
    expected_p = p - 0.1 * expected_v
    sgd_update(p, v, g, lr=0.1, momentum=0.9, weight_decay=0.01)
    np.testing.assert_allclose(v, expected_v, rtol=1e-6)
    np.testing.assert_allclose(p, expected_p, rtol=1e-6)


class _FeaturesGiven:
    """The conv side of a step stood in for: fixed features per micro-batch. `weights_later`: it
    calls the head as the peer step does (hetconv.coordinator.remote), the FC weights' gradients
    left due until head.settle(), and books whether they were still due when the head returned."""

    def __init__(self, features, weights_later):
        self.features, self.weights_later, self.due_at_return = features, weights_later, []

    def conv_step(self, xs, head, update, step=(0, 0), head_sum_of_squares=None):
        for m, x in enumerate(xs):
            h = self.features[m]
            if self.weights_later:
                head(m, h, weights_later=True)
                self.due_at_return.append(self.net.fc[0]._weight_grads_due is not None)
                head.settle()
            else:
                head(m, h)
        return 1.0


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_step_whose_head_leaves_the_weight_gradients_due_updates_the_same_bits(micro_batches):
    """The peer step sends the features' gradient before the head's weight GEMMs run; the update
    after the step is bit for bit the one of a head that computes them at once."""
    from hetconv.devices.cpu import HostArrays
    from hetconv.net.head import Network, paper_head
    from hetconv.update import UpdateRule

    rng = np.random.default_rng(7)
    images = rng.standard_normal((6, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 10, 6)
    features = rng.standard_normal((6, 4, 2, 2)).astype(np.float32)     # what the conv layers would make
    given = [features[p] for p in np.array_split(np.arange(6), micro_batches)]
    nets = []
    for later in (False, True):
        engine = _FeaturesGiven(given, later)
        net = Network([], paper_head([8], 10), engine, np.random.default_rng(0), (4, 2, 2), host=HostArrays())
        engine.net = net
        for step in range(2):
            net.train_step(images, labels, UpdateRule(lr=0.1, momentum=0.9), micro_batches=micro_batches, step=step)
        nets.append((net, engine))
    (now, _), (later, engine) = nets
    assert engine.due_at_return and all(engine.due_at_return)
    for a, b in zip(now.fc, later.fc):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b)
        assert all(np.array_equal(a.slots[k], b.slots[k]) for k in a.slots)
