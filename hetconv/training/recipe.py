"""The training recipe as the loop applies it: the optimizer and its hyper-parameters from the
config, the learning rate (and, for one-cycle, the momentum) of every step from the schedule, and
global-norm clipping, turned into the one UpdateRule each step sends to every holder of a weight.
A pure function of the step, so a resumed or replaying run continues exactly where it was."""
from hetconv.update import ADAM_FAMILY, UpdateRule, parse_no_decay
from hetconv.training.schedule import Schedule


def parse_betas(text):
    """--betas B1,B2 -> (b1, b2), each in [0, 1)."""
    try:
        betas = tuple(float(t) for t in str(text).split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"--betas must be two numbers in [0, 1) separated by a comma, such as 0.9,0.999; got {text!r}")
    return betas


def parse_milestones(text):
    """--milestones 30,60 -> (30, 60): increasing optimizer steps."""
    text = str(text).strip()
    if not text:
        return ()
    try:
        steps = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--milestones must be comma-separated step numbers, such as 30,60; got {text!r}") from None
    if any(s < 1 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"--milestones must be increasing step numbers >= 1, got {text!r}")
    return steps


def check_run_length(cfg, total_steps):
    """The schedule flags that depend on the run's length, against its `total_steps` updates
    (--epochs or --steps), each refused in one line naming its flag (Schedule, which the rest of
    the flags reach already checked by Config.check_recipe, would name its keyword instead)."""
    if cfg.warmup_steps >= total_steps:
        raise ValueError(f"--warmup-steps {cfg.warmup_steps} leaves --schedule {cfg.schedule} no step: the run has "
                         f"{total_steps} steps; give fewer warm-up steps, or more --epochs or --steps")
    main = total_steps - cfg.warmup_steps
    late = [m for m in parse_milestones(cfg.milestones) if m >= main] if cfg.schedule == "step" else []
    if late:
        run = (f"milestones count from the end of the {cfg.warmup_steps} --warmup-steps of the run's {total_steps} "
               f"steps" if cfg.warmup_steps else f"the run has {total_steps} steps")
        raise ValueError(f"--milestones {cfg.milestones}: {late[0]} is past the schedule's last step {main - 1} "
                         f"({run}); give milestones below {main}, or more --epochs or --steps")


class Recipe:
    """cfg's optimizer, schedule and clipping over a run of `total_steps` optimizer steps."""

    def __init__(self, cfg, total_steps):
        check_run_length(cfg, total_steps)
        self.cfg = cfg
        self.betas = parse_betas(cfg.betas)
        self.no_decay = parse_no_decay(cfg.no_decay)
        base_momentum = self.betas[0] if cfg.optimizer in ADAM_FAMILY else cfg.momentum
        self.schedule = Schedule(cfg.schedule, cfg.lr, total_steps, warmup_steps=cfg.warmup_steps,
                                 milestones=parse_milestones(cfg.milestones), gamma=cfg.gamma, min_lr=cfg.min_lr)
        self.base_momentum = base_momentum

    def rule(self, step):
        """The UpdateRule of optimizer step `step` (0-based: the step-th update of the run)."""
        cfg = self.cfg
        momentum = self.schedule.momentum_at(step)
        return UpdateRule(lr=self.schedule.lr_at(step), optimizer=cfg.optimizer,
                          momentum=self.base_momentum if momentum is None else momentum,
                          beta2=self.betas[1], eps=cfg.eps, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
                          no_decay=self.no_decay, step=step + 1, max_norm=cfg.clip_grad_norm)
