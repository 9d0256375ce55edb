"""Learning-rate and momentum schedules against PyTorch's schedulers driving a real optimizer."""
import math

import numpy as np
import pytest
import torch

from hetconv.training.schedule import Schedule

TOTAL = 50


def _torch_main(kind, optimizer, schedule):
    main = schedule.main_steps
    if kind == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if kind == "step":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, list(schedule.milestones), gamma=schedule.gamma)
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=main, eta_min=schedule.min_lr)
    cycle = schedule.momentum_cycle
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=schedule.lr, total_steps=main,
                                               cycle_momentum=cycle is not None)


def torch_values(schedule, optimizer_kind):
    """[(lr, momentum)] that torch's optimizer holds as it runs each update, its scheduler
    stepped after every optimizer.step()."""
    param = torch.nn.Parameter(torch.zeros(3))
    if optimizer_kind == "sgd":
        optimizer = torch.optim.SGD([param], lr=schedule.lr, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW([param], lr=schedule.lr, betas=(0.9, 0.999))
    if schedule.warmup_steps:
        n = schedule.warmup_steps
        # built in the order they run: OneCycleLR sets the group's initial_lr, which a LambdaLR
        # built after it would take as its base rate
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / n)
        main = _torch_main(schedule.kind, optimizer, schedule)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, main], milestones=[n])
    else:
        scheduler = _torch_main(schedule.kind, optimizer, schedule)
    values = []
    for _ in range(schedule.total_steps):
        group = optimizer.param_groups[0]
        values.append((group["lr"], group["momentum"] if optimizer_kind == "sgd" else group["betas"][0]))
        param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler.step()
    return values


CASES = {
    "constant": dict(kind="constant", lr=0.1),
    "step": dict(kind="step", lr=0.1, milestones=(10, 30), gamma=0.2),
    "cosine": dict(kind="cosine", lr=0.1, min_lr=1e-3),
    "onecycle": dict(kind="onecycle", lr=0.1),
    "onecycle-no-momentum": dict(kind="onecycle", lr=0.1, momentum_cycle=None),
}


@pytest.mark.parametrize("warmup", [0, 5], ids=["no-warmup", "warmup"])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_schedule_equals_torchs_scheduler(case, optimizer_kind, warmup):
    schedule = Schedule(total_steps=TOTAL, warmup_steps=warmup, **CASES[case])
    expected = torch_values(schedule, optimizer_kind)
    lrs = [schedule.lr_at(s) for s in range(TOTAL)]
    # cosine: torch multiplies the previous rate (its recursion), 8e-16 apart at most over 50 steps
    np.testing.assert_allclose(lrs, [lr for lr, _ in expected], rtol=1e-12, atol=0)
    momenta = [schedule.momentum_at(s) for s in range(TOTAL)]
    if schedule.kind == "onecycle" and schedule.momentum_cycle is not None:
        np.testing.assert_allclose(momenta, [m for _, m in expected], rtol=1e-12, atol=0)
    else:
        assert momenta == [None] * TOTAL
        assert {m for _, m in expected} == {0.9}    # torch left it alone too


def test_the_schedules_have_their_shapes():
    """Landmarks, independent of torch: warm-up from 0, the decays, the one cycle's peak."""
    step = Schedule("step", 1.0, 20, warmup_steps=4, milestones=(3, 8), gamma=0.5)
    assert [step.lr_at(s) for s in (0, 2, 4, 6, 7, 11, 12, 19)] == [0.0, 0.5, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    cosine = Schedule("cosine", 1.0, 10, min_lr=0.1)
    assert cosine.lr_at(0) == 1.0 and cosine.lr_at(5) == pytest.approx(0.55)
    cycle = Schedule("onecycle", 2.0, 100)
    assert cycle.lr_at(0) == pytest.approx(2.0 / 25) and cycle.lr_at(29) == pytest.approx(2.0)
    assert cycle.lr_at(99) == pytest.approx(2.0 / 25 / 1e4)
    assert cycle.momentum_at(0) == pytest.approx(0.95) and cycle.momentum_at(29) == pytest.approx(0.85)


def test_a_schedule_is_a_pure_function_of_the_step():
    """A resumed run asks for its next step alone and gets what the uninterrupted run got."""
    make = lambda: Schedule("cosine", 0.1, 30, warmup_steps=3, min_lr=1e-4)    # noqa: E731
    forward = [make().lr_at(s) for s in range(30)]
    resumed = make()
    assert [resumed.lr_at(s) for s in reversed(range(30))] == forward[::-1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="linear"), r"^schedule kind must be one of constant, step, cosine, onecycle, got 'linear'$"),
    (dict(lr=-1.0), r"^lr must be in \[0.0, inf\], got -1.0$"),
    (dict(lr=math.nan), r"^lr must be a finite number, got nan$"),
    (dict(total_steps=0), r"^total_steps must be an integer >= 1, got 0$"),
    (dict(total_steps=10.0), r"^total_steps must be an integer >= 1, got 10.0$"),
    (dict(warmup_steps=-1), r"^warmup_steps must be an integer >= 0, got -1$"),
    (dict(warmup_steps=50), r"^warmup_steps must leave the main schedule a step: 50 warm-up steps in a run of 50$"),
    (dict(kind="step"), r"^the step schedule needs milestones"),
    (dict(kind="step", milestones=(10, 10)), r"^milestones must increase, got \[10, 10\]$"),
    (dict(kind="step", milestones=(20, 10)), r"^milestones must increase, got \[20, 10\]$"),
    (dict(kind="step", milestones=(0,)), r"^milestone 0 is outside the main schedule's steps 1..49 "),
    (dict(kind="step", milestones=(45,), warmup_steps=5),
     r"^milestone 45 is outside the main schedule's steps 1..44 \(50 steps, 5 of warm-up\)$"),
    (dict(kind="step", milestones=(2.5,)), r"^milestones must be integers \(steps\), got 2.5$"),
    (dict(milestones=(10,)), r"^milestones apply to the step schedule, not to 'cosine'$"),
    (dict(kind="step", milestones=(10,), gamma=0), None),
    (dict(min_lr=0.5), r"^min_lr must be in \[0.0, 0.1\], got 0.5$"),
    (dict(kind="onecycle", min_lr=0.01), r"^min_lr applies to the cosine schedule, not to 'onecycle'$"),
    (dict(momentum_cycle=(0.95, 0.85)), r"^momentum_cycle's highest must be in \[0.95, 1.0\], got 0.85$"),
    (dict(momentum_cycle=0.9), r"^momentum_cycle must be a \(lowest, highest\) pair or None, got 0.9$"),
], ids=lambda v: None)
def test_bad_schedules_are_refused_in_one_line(kwargs, message):
    args = dict(kind="cosine", lr=0.1, total_steps=50)
    args.update(kwargs)
    if message is None:      # a gamma of 0 stops training at the milestone; allowed, as torch allows it
        Schedule(**args)
        return
    with pytest.raises(ValueError, match=message):
        Schedule(**args)


@pytest.mark.parametrize("step", [-1, 50, 3.0, True])
def test_a_step_outside_the_run_is_refused(step):
    with pytest.raises(ValueError, match=r"^step must be an integer in 0..49 \(the run's updates\), got "):
        Schedule("onecycle", 0.1, 50).lr_at(step)
