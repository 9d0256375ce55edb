"""One step's parameter update, as data: the optimizer, this step's hyper-parameters (the
schedule's learning rate and momentum at this step), the parameter groups that take no weight
decay, and the factor gradient clipping scales every gradient by. The coordinator makes one per
step and sends it with the step; every holder of a parameter (a worker's shard, the coordinator's
head) applies it with its device's update kernel, so every copy of a weight moves by the same
arithmetic (DESIGN.md, "Faults and trust").

The optimizers are PyTorch's, by name and by arithmetic: `sgd` is torch.optim.SGD (dampening 0,
coupled weight decay, optional Nesterov), `adamw` is torch.optim.AdamW (decoupled weight decay,
amsgrad off), `adam` torch.optim.Adam (the same moments, the weight decay coupled: L2 added to the
gradient). Parameter groups are PyTorch's usual ones: "weight" (conv and linear weights),
"bias" (every bias, BatchNorm's included) and "norm" (normalisation weights).
"""
from dataclasses import dataclass, fields
import math

OPTIMIZERS = ("sgd", "adamw", "adam")
ADAM_FAMILY = ("adamw", "adam")     # beta1 is their momentum; --betas and --eps are theirs
OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW", "adam": "Adam"}     # torch.optim's class names
GROUPS = ("weight", "bias", "norm")

# The state an optimizer keeps per parameter, named as torch.optim names it in its state_dict.
SLOTS = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq")}


def slot_name(param, slot):
    """The name of a parameter's optimizer state array: "w.momentum_buffer", "bn0.weight.exp_avg"."""
    return f"{param}.{slot}"


def parse_no_decay(text):
    """--no-decay: a comma list of parameter groups ("bias", "norm"), '' for none -> a tuple."""
    names = tuple(t.strip() for t in str(text).split(",") if t.strip())
    bad = [n for n in names if n not in ("bias", "norm")]
    if bad:
        raise ValueError(f"--no-decay {text!r}: unknown group {bad[0]!r}; expected a comma list of bias and norm, "
                         f"or '' for none")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class UpdateRule:
    lr: float
    optimizer: str = "sgd"
    momentum: float = 0.9           # SGD's momentum; Adam(W)'s beta1 (one-cycle schedules cycle it)
    beta2: float = 0.999            # Adam(W)
    eps: float = 1e-8               # Adam(W)
    weight_decay: float = 0.0       # coupled (SGD, Adam) or decoupled (AdamW)
    nesterov: bool = False          # SGD
    no_decay: tuple = ("bias",)     # parameter groups that take no weight decay
    step: int = 1                   # the 1-based count of this update (Adam(W)'s bias correction)
    max_norm: float = 0.0           # global-norm clipping of every gradient together (0: none)
    grad_scale: float = 1.0         # every gradient times this first (clipping's factor), 1: none

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("lr", "momentum", "beta2", "eps", "weight_decay", "max_norm", "grad_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"update {name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not self.momentum < 1 or not self.beta2 < 1:
            raise ValueError(f"update momentum and beta2 must be < 1, got {self.momentum}, {self.beta2}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"update nesterov must be true or false, got {self.nesterov!r}")
        groups = tuple(self.no_decay)
        if any(g not in GROUPS for g in groups):
            raise ValueError(f"update no_decay must list groups of {', '.join(GROUPS)}, got {list(groups)!r}")
        object.__setattr__(self, "no_decay", groups)
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"update step must be an integer >= 1, got {self.step!r}")

    @property
    def slots(self):
        return SLOTS[self.optimizer]

    def decay(self, group):
        """The weight decay of a parameter of `group`."""
        return 0.0 if group in self.no_decay else self.weight_decay

    def to_json(self):
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["no_decay"] = list(self.no_decay)
        return d

    @classmethod
    def from_json(cls, d):
        """From the wire: a map of exactly these fields (any wrong one is a ValueError naming it)."""
        if not isinstance(d, dict):
            raise ValueError(f"an update must be a map, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown update field(s) {unknown}: expected some of {sorted(known)}")
        if "lr" not in d:
            raise ValueError("an update needs its 'lr'")
        if not isinstance(d.get("no_decay", []), (list, tuple)):
            raise ValueError(f"update no_decay must be a list, got {d['no_decay']!r:.60}")
        return cls(**d)

    def scaled(self, factor):
        """The same update with every gradient multiplied by `factor` too."""
        return UpdateRule(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                             "grad_scale": self.grad_scale * float(factor)})


def apply_update(device, param, slots, grad, rule, group):
    """In place where the arrays live: one parameter of `group` ("weight", "bias", "norm") moved by
    `rule`, `slots` its optimizer state by slot name. `grad` may be scaled in place (clipping)."""
    if rule.grad_scale != 1.0:
        device.scale_(grad, rule.grad_scale)
    decay = rule.decay(group)
    if rule.optimizer == "sgd":
        device.sgd_(param, slots["momentum_buffer"], grad, rule.lr, rule.momentum, decay, nesterov=rule.nesterov)
    else:
        update = device.adamw_ if rule.optimizer == "adamw" else device.adam_
        update(param, slots["exp_avg"], slots["exp_avg_sq"], grad, rule.lr, rule.momentum, rule.beta2, rule.eps, decay,
               rule.step)


def clip_factor(total_sum_of_squares, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor for a global norm: max_norm / (norm + 1e-6), at
    most 1; 1 where clipping is off (max_norm 0)."""
    if not max_norm:
        return 1.0
    norm = math.sqrt(max(float(total_sum_of_squares), 0.0))
    return min(1.0, float(max_norm) / (norm + 1e-6))
