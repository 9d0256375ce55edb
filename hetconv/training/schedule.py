"""Learning-rate and momentum schedules: pure functions of the optimizer step.

`step` is the 0-based index of the update (the first update is step 0), so a resumed run asks for
the values of the step it resumes at and continues exactly where it stopped: nothing is kept
between calls. Each kind equals the PyTorch scheduler named beside it, driving a torch optimizer
whose scheduler.step() runs after every optimizer.step() (tests/test_schedule.py):

    constant    the learning rate throughout
    step        MultiStepLR(milestones, gamma): times gamma at each milestone reached
    cosine      CosineAnnealingLR(T_max = the main steps, eta_min = min_lr)
    onecycle    OneCycleLR(max_lr = lr, total_steps = the main steps) with PyTorch's defaults: 30%
                of the steps up from lr/25, then down to lr/25/1e4 (cosine both ways), while the
                momentum (SGD's momentum, AdamW's beta1) goes down from 0.95 to 0.85 and back

warmup_steps N puts a linear warm-up before any of them: lr * s / N at step s < N; the main
schedule then runs over the remaining total_steps - N steps, its own step counting from 0 at the
end of the warm-up, milestones included (torch's SequentialLR([LambdaLR(lambda s: s / N), main],
milestones=[N]) does so). A one-cycle schedule after a warm-up starts again from lr/25, as that
composition does, and its momentum stays at the top of its range during the warm-up.

Torch's step and cosine schedulers multiply the previous step's rate (a recursion); these are
their closed forms, equal to within a few float64 roundings.
"""
import math
from bisect import bisect_right
from dataclasses import dataclass

KINDS = ("constant", "step", "cosine", "onecycle")
# OneCycleLR's defaults: the share of the steps going up, initial lr = max_lr / DIV, final lr =
# initial lr / FINAL_DIV
ONECYCLE_PCT_START = 0.3
ONECYCLE_DIV = 25.0
ONECYCLE_FINAL_DIV = 1e4


def _count(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _number(name, value, low, high=math.inf):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
    return float(value)


def _anneal_cos(start, end, pct):
    """OneCycleLR's cosine from start (pct 0) to end (pct 1), its own expression."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


@dataclass(frozen=True)
class Schedule:
    """lr_at(step) and momentum_at(step) of one run; see the module's docstring for each kind.

    kind           constant, step, cosine or onecycle
    lr             the base learning rate (onecycle's peak)
    total_steps    optimizer updates in the whole run, warm-up included
    warmup_steps   linear warm-up from 0 before the main schedule
    milestones     step: the main schedule's steps at which the rate is multiplied by gamma,
                   increasing, each within the main schedule's steps
    gamma          step: the factor at each milestone
    min_lr         cosine: the rate it ends at
    momentum_cycle onecycle: (lowest, highest) momentum, or None to leave the momentum alone
    """
    kind: str
    lr: float
    total_steps: int
    warmup_steps: int = 0
    milestones: tuple = ()
    gamma: float = 0.1
    min_lr: float = 0.0
    momentum_cycle: tuple | None = (0.85, 0.95)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"schedule kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

        def set_(name, value):      # the checked, normalised value, on a frozen dataclass
            object.__setattr__(self, name, value)
        set_("lr", _number("lr", self.lr, 0.0))
        set_("total_steps", _count("total_steps", self.total_steps, 1))
        set_("warmup_steps", _count("warmup_steps", self.warmup_steps, 0))
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"warmup_steps must leave the main schedule a step: {self.warmup_steps} warm-up "
                             f"steps in a run of {self.total_steps}")
        set_("gamma", _number("gamma", self.gamma, 0.0))
        set_("min_lr", _number("min_lr", self.min_lr, 0.0, self.lr))
        if self.kind != "cosine" and self.min_lr:
            raise ValueError(f"min_lr applies to the cosine schedule, not to {self.kind!r}")
        self._check_milestones()
        if self.momentum_cycle is not None:
            if not isinstance(self.momentum_cycle, (tuple, list)) or len(self.momentum_cycle) != 2:
                raise ValueError(f"momentum_cycle must be a (lowest, highest) pair or None, "
                                 f"got {self.momentum_cycle!r}")
            low = _number("momentum_cycle's lowest", self.momentum_cycle[0], 0.0, 1.0)
            high = _number("momentum_cycle's highest", self.momentum_cycle[1], low, 1.0)
            set_("momentum_cycle", (low, high))

    def _check_milestones(self):
        milestones = tuple(self.milestones)
        if self.kind != "step":
            if milestones:
                raise ValueError(f"milestones apply to the step schedule, not to {self.kind!r}")
            object.__setattr__(self, "milestones", ())
            return
        if not milestones:
            raise ValueError("the step schedule needs milestones (steps at which the rate is multiplied by gamma)")
        main = self.main_steps
        for i, m in enumerate(milestones):
            if isinstance(m, bool) or not isinstance(m, int):
                raise ValueError(f"milestones must be integers (steps), got {m!r}")
            if not 0 < m < main:
                raise ValueError(f"milestone {m} is outside the main schedule's steps 1..{main - 1} "
                                 f"({self.total_steps} steps, {self.warmup_steps} of warm-up)")
            if i and m <= milestones[i - 1]:
                raise ValueError(f"milestones must increase, got {list(milestones)!r}")
        object.__setattr__(self, "milestones", milestones)

    @property
    def main_steps(self):
        return self.total_steps - self.warmup_steps

    def _main_step(self, step):
        """step - warmup_steps after checking step; negative during the warm-up."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.total_steps:
            raise ValueError(f"step must be an integer in 0..{self.total_steps - 1} (the run's updates), got {step!r}")
        return step - self.warmup_steps

    def lr_at(self, step):
        """The learning rate of update `step` (0-based)."""
        t = self._main_step(step)
        if t < 0:
            return self.lr * (step / self.warmup_steps)
        if self.kind == "constant":
            return self.lr
        if self.kind == "step":
            return self.lr * self.gamma ** bisect_right(self.milestones, t)
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * t / self.main_steps)) / 2
        return self._one_cycle(t)[0]

    def momentum_at(self, step):
        """The momentum (SGD) or beta1 (AdamW) of update `step`, or None where the schedule
        leaves it alone (every kind but onecycle, or momentum_cycle None)."""
        t = self._main_step(step)
        if self.kind != "onecycle" or self.momentum_cycle is None:
            return None
        if t < 0:
            return self.momentum_cycle[1]
        return self._one_cycle(t)[1]

    def _one_cycle(self, t):
        """(lr, momentum) at main step t: OneCycleLR's two phases, its own arithmetic."""
        initial = self.lr / ONECYCLE_DIV
        low, high = self.momentum_cycle or (0.0, 0.0)
        up_end = float(ONECYCLE_PCT_START * self.main_steps) - 1
        if t <= up_end:
            pct = (t - 0.0) / (up_end - 0.0)
            return _anneal_cos(initial, self.lr, pct), _anneal_cos(high, low, pct)
        pct = (t - up_end) / (self.main_steps - 1 - up_end)
        return _anneal_cos(self.lr, initial / ONECYCLE_FINAL_DIV, pct), _anneal_cos(low, high, pct)
