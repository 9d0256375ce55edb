"""softmax_cross_entropy with label smoothing against F.cross_entropy and its autograd gradient."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hetconv.net.layers import softmax_cross_entropy


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.5, 1.0])
def test_label_smoothed_loss_and_gradient_equal_torchs(label_smoothing):
    rng = np.random.default_rng(int(label_smoothing * 10))
    logits = (rng.standard_normal((16, 10)) * 3).astype(np.float32)
    labels = rng.integers(0, 10, 16)
    loss, grad = softmax_cross_entropy(logits, labels, label_smoothing=label_smoothing)

    t = torch.tensor(logits, requires_grad=True)
    expected = F.cross_entropy(t, torch.tensor(labels), label_smoothing=label_smoothing)
    expected.backward()
    assert grad.dtype == np.float32 and grad.shape == logits.shape
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-6, atol=1e-8)


def test_no_smoothing_keeps_the_plain_cross_entropy():
    logits = np.array([[2.0, 0.5, -1.0], [0.0, 0.0, 3.0]], np.float32)
    labels = np.array([0, 1])
    loss, grad = softmax_cross_entropy(logits, labels)
    probs = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True)
    assert loss == pytest.approx(-np.log(probs[[0, 1], labels]).mean(), rel=1e-12)
    probs[[0, 1], labels] -= 1
    np.testing.assert_allclose(grad, (probs / 2).astype(np.float32), rtol=1e-6)


def test_smoothing_pulls_a_confident_right_answer_back():
    """Smoothed, a loss is paid even for a certain right answer, and its gradient lowers the
    winning logit."""
    logits, labels = np.array([[20.0, 0.0, 0.0]]), np.array([0])
    plain, _ = softmax_cross_entropy(logits, labels)
    smoothed, grad = softmax_cross_entropy(logits, labels, label_smoothing=0.3)
    assert plain < 1e-6 < smoothed and grad[0, 0] > 0 > grad[0, 1]


@pytest.mark.parametrize("logits, labels, smoothing, message", [
    (np.zeros((2, 3)), np.array([0, 3]), 0.0, r"^labels must be class indices in 0..2, got 0..3$"),
    (np.zeros((2, 3)), np.array([0, -1]), 0.0, r"^labels must be class indices in 0..2, got -1..0$"),
    (np.zeros((2, 3)), np.array([0]), 0.0,
     r"^labels must be 2 integers \(one per row of logits\), got int64 shape \(1,\)$"),
    (np.zeros((2, 3)), np.array([0.0, 1.0]), 0.0, r"^labels must be 2 integers"),
    (np.zeros(3), np.array([0]), 0.0, r"^logits must be \(batch, classes\), got shape \(3,\)$"),
    (np.zeros((2, 3)), np.array([0, 1]), 1.5, r"^label_smoothing must be in \[0, 1\], got 1.5$"),
    (np.zeros((2, 3)), np.array([0, 1]), -0.1, r"^label_smoothing must be in \[0, 1\], got -0.1$"),
    (np.zeros((2, 3)), np.array([0, 1]), True, r"^label_smoothing must be in \[0, 1\], got True$"),
], ids=lambda v: None)
def test_bad_loss_inputs_are_refused_in_one_line(logits, labels, smoothing, message):
    with pytest.raises(ValueError, match=message):
        softmax_cross_entropy(logits, labels, label_smoothing=smoothing)
