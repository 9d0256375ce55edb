"""torchvision's own networks through hetconv, trained as PyTorch trains them: a user file builds
`torchvision.models.mobilenet_v2(num_classes=10, width_mult=0.25)` with a CIFAR stem (its first
conv 3x3 stride 1), hetconv imports it by tracing, trains it `--local` (one shard, one thread)
for a few steps of synthetic 32x32 images, and PyTorch trains the same module on the same batches
with torch.optim.SGD, in float64 (the exact answer) and in float32; the losses and every
state_dict entry are compared with the float64 run.

Why float64: in this deep, narrow network PyTorch's own float32 step is not the reference to
1e-4. Its first step's gradients differ from its float64 step's by ~2e-2 (relative norm) from the
last block down (torchvision's mobilenet_v2 at width 0.25, batch 16), where hetconv's differ by
~1e-5: a ReLU6 input within float32 rounding of a kink falls on the other side in one
implementation, and that element's gradient is not rounding. Which way such an element falls
depends on the float32 path that computed it (hetconv's depthwise convs moving from the im2col path
to their own kernels flipped one: 1e-5 against 3.9e-2). So the float64 reference takes its ReLU6
masks from its own inputs except within KINK_MARGIN of 0 or 6, where no float32 computation decides
reliably: there it takes hetconv's (the inputs of hetconv's ReLU6s in its step, recorded); the
count of such elements, and of those where the two differ, is reported, and so is the error
against the plain float64 step. Over several steps any float32 run (PyTorch's or hetconv's) then
leaves the float64 one. So the check is one step's gradients (a step of SGD at lr 1 without
momentum: the weights move by the gradient), each parameter's against that float64 step's to 1e-4
of its norm, or of a hundredth of the network's largest gradient norm
where its own is smaller: a gradient that is a nearly cancelling sum (the scale of a BatchNorm
after a 1x1 expansion: ~1e-4 of its neighbours' norms) or zero (a BatchNorm bias whose every
reader is a conv then a BatchNorm) keeps the rounding of its terms, not of its value. The losses
of a few steps are shown beside, PyTorch float32's too. The same one step runs on two one-thread
worker processes (`--parallel auto`, then `--parallel model`), checked the same way; and the
exported program of the few steps' checkpoint (`hetconv-export --format torch`) gives the logits
of torchvision's module holding the same state, in eval mode.

    python bench/zoo.py --out bench/results/zoo
    python bench/zoo.py --torchvision-path /tmp/tv   # an unpacked torchvision wheel
    python bench/zoo.py --timing --rounds 3          # step times: bench/results/zoo/mobilenet_v2_steps.md

`--timing` times training steps instead (no torchvision needed): the mobilenet_v2 preset (the same
network with the CIFAR ports' 24-channel stage at stride 1 too), width 1.0 and batch 32 unless
--width and --batch-size say otherwise, hetconv --local on one device of 2 threads in fp32, bf16 and
auto, against PyTorch (2 threads) in float32 and under bf16 autocast, each in NCHW and channels_last
(compared by the faster), in rounds of alternating order: bench/precision.py's rows and table.

The classifier's Dropout(0.2) is set to p=0 in the user file: hetconv and PyTorch draw their
dropout masks from different generators, so with p>0 the two runs see different networks.

torchvision is not a dependency of hetconv; see bench/torchvision_resnet.py for
`--torchvision-path` and a wheel built for another torch.
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

USER_FILE = '''import sys
import types
# torchvision's compiled ops are not needed by these networks; a wheel for another torch build fails to register them
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
import torch
from torch import nn
from torchvision.models import mobilenet_v2


def build():
    torch.manual_seed(0)
    model = mobilenet_v2(num_classes=10, width_mult={width})
    stem = model.features[0][0]
    model.features[0][0] = nn.Conv2d(3, stem.out_channels, 3, stride=1, padding=1, bias=False)   # CIFAR stem
    model.classifier[0].p = 0.0             # hetconv's dropout masks are not PyTorch's
    return model
'''


def torch_steps(cfg, module, steps, dtype):
    """The batches hetconv's loop draws for cfg, through `module` in `dtype` with torch.optim.SGD:
    the losses and the final state_dict (as float32)."""
    import numpy as np
    import torch
    from hetconv.data import batches, load_dataset
    module = module.to(dtype)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=0.0)
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=cfg.synthetic_train, n_test=cfg.synthetic_test)
    losses = []
    for step, (x, y) in enumerate(batches(ds, cfg.batch_size, np.random.default_rng([cfg.seed, 0]))):
        if step == steps:
            break
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in module.state_dict().items()}


KINK_MARGIN = 1e-4      # a ReLU6 input this close to 0 or 6 in float64 takes hetconv's mask


def recording_relu6_inputs():
    """A copy of every ReLU6 input the CPU device's activation kernel sees from now on, in call
    order (-> the list, and a function that stops the recording)."""
    from hetconv.devices import cpu_channelwise
    kept, original = [], cpu_channelwise.activation

    def activation(x, act):
        if act.kind == "relu6":
            kept.append(x.copy())
        return original(x, act)

    cpu_channelwise.activation = activation
    return kept, lambda: setattr(cpu_channelwise, "activation", original)


def with_hetconv_kink_masks(module, hetconv_inputs, counts):
    """`module` with each nn.ReLU6 replaced by one whose gradient mask is float64's own (0 < x <
    6) except within KINK_MARGIN of a kink, where it is hetconv's (from the next of
    `hetconv_inputs`, its float32 inputs in forward order); counts["near"] and counts["differ"]
    add up those elements and those where the two masks differ."""
    import torch

    class Masked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mask):
            ctx.save_for_backward(mask)
            return x.clamp(0.0, 6.0)

        @staticmethod
        def backward(ctx, g):
            (mask,) = ctx.saved_tensors
            return g * mask, None

    class KinkMaskedReLU6(torch.nn.Module):
        def forward(self, x):
            if not hetconv_inputs:
                raise RuntimeError("more ReLU6 calls in the PyTorch module than hetconv's step recorded")
            ours = torch.from_numpy(hetconv_inputs.pop(0)).to(x.dtype)
            if ours.shape != x.shape:
                raise RuntimeError(f"hetconv's ReLU6 input {tuple(ours.shape)} is not PyTorch's {tuple(x.shape)}")
            own, theirs = (x > 0) & (x < 6), (ours > 0) & (ours < 6)
            near = (x.abs() < KINK_MARGIN) | ((x - 6).abs() < KINK_MARGIN)
            counts["near"] += int(near.sum())
            counts["differ"] += int((own != theirs).sum())
            if bool(((own != theirs) & ~near).any()):
                raise RuntimeError(f"hetconv's ReLU6 masks differ from float64's away from a kink "
                                   f"({int(((own != theirs) & ~near).sum())} elements): not the same step")
            return Masked.apply(x, torch.where(near, theirs, own).to(x.dtype))

    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ReLU6):
                setattr(parent, name, KinkMaskedReLU6())
    return module


# what one flipped ReLU6 mask in a worker's share may leave (see the report's note)
FLIPPED_AFTER_AT_LEAST, FLIPPED_ERROR = 8, 2e-2


def exported_against_torch(cfg, target, spec, state, tmp):
    """The .pt2 hetconv-export writes of cfg's checkpoint, run by torch on random images, against
    the user's module holding the same state (`state`, torchvision's keys) in eval mode."""
    import numpy as np
    import torch
    from hetconv.cli import export
    from hetconv.net.torch_import import load_module
    from hetconv.training import checkpoint
    program = os.path.join(tmp, "zoo.pt2")
    if export.main([cfg.checkpoint_dir, "--format", "torch", "--out", program]) not in (0, None):
        raise RuntimeError("hetconv-export failed")
    module = load_module(target)
    module.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    module.eval()
    data = checkpoint.load(cfg.checkpoint_dir)[0]["data"]
    images = np.random.default_rng(1).random((8, 3, 32, 32), dtype=np.float32)       # in [0, 1]
    mean = np.asarray(data["mean"], np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(data["std"], np.float32).reshape(1, 3, 1, 1)
    with torch.no_grad():
        theirs = torch.export.load(program).module()(torch.from_numpy(images)).numpy()
        want = module(torch.from_numpy((images - mean) / std)).numpy()
    return {"images": len(images), "max_relative_difference": float(np.abs(theirs - want).max() / np.abs(want).max())}


def gradient_errors(ours, start, state, floor=1e-2):
    """{parameter: |our gradient - float64's| / max(|float64's|, floor * the largest of them)}
    from one SGD step at lr 1 without momentum (the gradient is start - after)."""
    import numpy as np
    g64 = {k: w0.astype(np.float64) - state[k] for k, w0 in start.items()}
    least = floor * max(np.linalg.norm(g) for g in g64.values())
    return {k: float(np.linalg.norm((w0.astype(np.float64) - ours[k]) - g64[k]) / max(np.linalg.norm(g64[k]), least))
            for k, w0 in start.items()}


TIMING_CONFIGS = ("hetconv local fp32", "hetconv local bf16", "hetconv local auto", "torch fp32", "torch bf16 autocast")


def step_timing(args):
    """--timing: bench/precision.py's rows for the mobilenet_v2 preset, its results beside ours."""
    import precision
    width = 1.0 if args.width is None else args.width
    batch = 32 if args.batch_size is None else args.batch_size
    return precision.main(["--nets", f"mobilenet_v2@{width:g}:{batch}", "--batch-size", str(batch),
                           "--configs", ",".join(TIMING_CONFIGS), "--rounds", str(args.rounds),
                           "--steps", str(args.timed_steps), "--no-gemm", "--out", args.out,
                           "--stem", f"{args.name}_steps"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "zoo"))
    p.add_argument("--name", default="mobilenet_v2")
    p.add_argument("--torchvision-path", default="", help="a folder holding an unpacked torchvision wheel")
    p.add_argument("--width", type=float, default=None, help="width_mult (default 0.25; with --timing 1.0)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=None, help="default 16; with --timing 32")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timing", action="store_true", help="time training steps against PyTorch instead (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--timing's rounds")
    p.add_argument("--timed-steps", type=int, default=4, help="--timing's timed steps per row, after 2 warm-up steps")
    args = p.parse_args(argv)
    if args.timing:
        return step_timing(args)
    args.width = 0.25 if args.width is None else args.width
    args.batch_size = 16 if args.batch_size is None else args.batch_size
    if args.torchvision_path:
        sys.path.insert(0, args.torchvision_path)
    import numpy as np
    from hetconv.devices import open_device
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.shard import ConvShard
    from hetconv.coordinator.remote import RemoteEngine
    from hetconv.net import load_net
    from hetconv.net.torch_import import load_module, state_dict
    from hetconv.training import checkpoint
    from hetconv.training.config import Config
    from hetconv.training.loop import train
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        user = os.path.join(tmp, "mynet.py")
        with open(user, "w") as f:
            f.write(USER_FILE.format(width=args.width))
        target = f"{user}:build"
        cfg = Config(net=target, batch_size=args.batch_size, synthetic_train=10 * args.batch_size,
                     synthetic_test=2 * args.batch_size, steps=args.steps, lr=args.lr, momentum=0.9,
                     weight_decay=0.0, threads=1, rebalance_after=0, eval_batches=1,
                     checkpoint_dir=os.path.join(tmp, "ck")).validate()
        spec = load_net(target, (3, 32, 32), 10).spec

        def ours(run):
            summary = train(run, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=lambda *_: None)
            _, conv, fc = checkpoint.load(run.checkpoint_dir)
            return summary["losses"], state_dict(spec, conv, [(layer["w"], layer["b"]) for layer in fc])
        import torch
        one = Config(**{**cfg.to_json(), "steps": 1, "lr": 1.0, "momentum": 0.0,
                        "checkpoint_dir": os.path.join(tmp, "one")}).validate()
        start = {k: v.detach().numpy() for k, v in load_module(target).named_parameters()}
        relu6_inputs, stop = recording_relu6_inputs()
        try:
            _, after = ours(one)
        finally:
            stop()
        # the step's forward: its first calls on a whole batch (an evaluation after it runs on
        # the moved weights; the check below refuses any other step's inputs)
        relu6_inputs = [x for x in relu6_inputs if x.shape[0] == args.batch_size]
        kinks = {"near": 0, "differ": 0}
        _, after64 = torch_steps(one, with_hetconv_kink_masks(load_module(target), relu6_inputs, kinks), 1,
                                 torch.float64)
        _, plain64 = torch_steps(one, load_module(target), 1, torch.float64)
        _, after32 = torch_steps(one, load_module(target), 1, torch.float32)
        grads, grads32 = gradient_errors(after, start, after64), gradient_errors(after32, start, plain64)
        plain = gradient_errors(after, start, plain64)
        on_workers = {}
        for parallel in ("auto", "model"):       # the same step on two worker processes
            run = Config(**{**one.to_json(), "parallel": parallel, "use_all": True,
                            "checkpoint_dir": os.path.join(tmp, f"workers-{parallel}")}).validate()
            engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu", "cpu"], threads=1, connect_timeout=60,
                                  log=lambda *_: None)
            try:
                train(run, engine, log=lambda *_: None)
                modes = [lp.mode for lp in engine.plan.layers]
            finally:
                engine.close()
            _, conv, fc = checkpoint.load(run.checkpoint_dir)
            got = state_dict(spec, conv, [(layer["w"], layer["b"]) for layer in fc])
            on_workers[parallel] = {"modes": {m: modes.count(m) for m in sorted(set(modes))},
                                    "against_local": gradient_errors(got, start, after),
                                    "against_float64": gradient_errors(got, start, after64)}
        t1 = time.time()
        mine_losses, mine = ours(cfg)
        hetconv_s = time.time() - t1
        logits = exported_against_torch(cfg, target, spec, mine, tmp)
        t1 = time.time()
        single, _ = torch_steps(cfg, load_module(target), args.steps, torch.float32)
        torch_s = time.time() - t1
        theirs, state = torch_steps(cfg, load_module(target), args.steps, torch.float64)
        ours = mine_losses
    order = list(start)                      # the module's parameters in forward order
    workers_worst = {}
    for p, w in on_workers.items():
        errors = w["against_float64"]
        over = [k for k in order if errors[k] > 1e-4]
        # a flipped ReLU6 mask's gradient reaches every tensor before it: the tensors after the
        # deepest one over 1e-4 must hold to 1e-4
        after = order[order.index(over[-1]) + 1:] if over else order
        workers_worst[p] = {"modes": w["modes"], "against_local": max((e, k) for k, e in w["against_local"].items()),
                            "against_float64": max((e, k) for k, e in errors.items()),
                            "deepest_over_1e-4": over[-1] if over else None, "tensors_over_1e-4": len(over),
                            "after_it": len(after), "worst_after_it": max((errors[k] for k in after), default=0.0)}
    loss_rel = float(np.max(np.abs(np.array(ours) - theirs) / np.abs(theirs)))
    single_rel = float(np.max(np.abs(np.array(single) - theirs) / np.abs(theirs)))
    worst, worst32 = max((e, k) for k, e in grads.items()), max((e, k) for k, e in grads32.items())
    worst_plain = max((e, k) for k, e in plain.items())
    types = {}
    for layer in spec.layers:
        types[layer.type] = types.get(layer.type, 0) + 1
    result = {"machine": _common.cpu_model(), "network": f"torchvision mobilenet_v2(width_mult={args.width}), "
              f"CIFAR stem", "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
              "layers": types, "hetconv_losses": ours, "torch_float64_losses": theirs, "torch_float32_losses": single,
              "loss_max_relative_difference": loss_rel, "torch_float32_loss_max_relative_difference": single_rel,
              "gradient_worst_relative_error": worst[0], "gradient_worst_key": worst[1],
              "gradients_match_1e-4": worst[0] <= 1e-4, "gradients_checked": len(grads),
              "torch_float32_gradient_worst_relative_error": worst32[0], "torch_float32_gradient_worst_key": worst32[1],
              "kink_margin": KINK_MARGIN, "relu6_inputs_near_a_kink": kinks["near"],
              "relu6_masks_hetconv_differs_near_a_kink": kinks["differ"],
              "gradient_worst_relative_error_against_plain_float64": worst_plain[0],
              "gradient_worst_key_against_plain_float64": worst_plain[1],
              "keys_are_torchvision_s": sorted(mine) == sorted(state),
              "two_workers": workers_worst, "exported_logits": logits,
              "hetconv_train_s": hetconv_s, "torch_train_s": torch_s, "wall_s": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    command = _common.recorded_command("zoo.py", sys.argv[1:] if argv is None else argv)
    ok = (result["gradients_match_1e-4"] and result["keys_are_torchvision_s"]
          and all(w["worst_after_it"] <= 1e-4 and w["against_float64"][0] <= FLIPPED_ERROR
                  and w["after_it"] >= FLIPPED_AFTER_AT_LEAST for w in workers_worst.values())
          and logits["max_relative_difference"] <= 1e-4)
    lines = [f"Machine: {result['machine']} (shared with other work). Command: `{command}` "
             f"({result['wall_s']:.0f} s).", "",
             f"{result['network']}: {len(spec.conv_layers())} conv blocks "
             f"({', '.join(f'{n} {t}' for t, n in sorted(types.items()))}), traced from the module. "
             f"{args.steps} SGD steps (lr {args.lr}, momentum 0.9) of {args.batch_size} synthetic 32x32 images, "
             f"hetconv `--local` (float32) against PyTorch on the same batches:", "",
             "| step | hetconv loss | PyTorch float64 | PyTorch float32 |", "|---|---|---|---|"] + \
        [f"| {i} | {a:.6f} | {b:.6f} | {c:.6f} |" for i, (a, b, c) in enumerate(zip(ours, theirs, single))] + \
        ["", f"- one step's gradients against PyTorch float64's, {len(grads)} parameters (each against its norm, at least "
             f"1e-2 of the largest): hetconv's "
             f"worst {worst[0]:.2e} of the norm ({worst[1]}; within 1e-4: {result['gradients_match_1e-4']}), the "
             f"float64 step's ReLU6 masks within {KINK_MARGIN:g} of a kink taken from hetconv's inputs "
             f"({kinks['near']} elements, {kinks['differ']} of them differing from float64's own); against the "
             f"plain float64 step hetconv's worst {worst_plain[0]:.2e} ({worst_plain[1]}), "
             f"PyTorch float32's {worst32[0]:.2e} ({worst32[1]})",
         f"- losses against PyTorch float64: hetconv's largest relative difference {loss_rel:.2e}, PyTorch "
         f"float32's {single_rel:.2e}",
         *[f"- the same step on two one-thread worker processes, `--parallel {p}` "
           f"({', '.join(f'{n} {m}' for m, n in w['modes'].items())} conv blocks): worst {w['against_float64'][0]:.2e} "
           f"against the float64 step above ({w['against_float64'][1]}), {w['against_local'][0]:.2e} against "
           f"`--local`'s ({w['against_local'][1]}); "
           + (f"{w['tensors_over_1e-4']} tensors over 1e-4, the deepest {w['deepest_over_1e-4']}; the "
              f"{w['after_it']} after it within {w['worst_after_it']:.2e}" if w["deepest_over_1e-4"] else
              "every tensor within 1e-4") for p, w in workers_worst.items()],
         f"  (the float32 arithmetic of a worker's share is not --local's: a ReLU6 input within its rounding of a "
         f"kink can fall on the other side, and that element's gradient is not rounding. It reaches every tensor "
         f"before that ReLU6 in the network (the backward carries it down), at up to ~1e-2 of their norms, and "
         f"none after it. So the check: every tensor after the deepest one over 1e-4 within 1e-4 (at least "
         f"{FLIPPED_AFTER_AT_LEAST} of them), none over {FLIPPED_ERROR:g}: a wrong gradient would be off after it "
         f"too, and by its own size.)",
         f"- the exported program (`hetconv-export --format torch`, the {args.steps}-step run's checkpoint) on "
         f"{logits['images']} images against torchvision's module holding the same state in eval mode: logits "
         f"within {logits['max_relative_difference']:.2e} of their largest",
         f"- hetconv's state_dict keys are torchvision's: {result['keys_are_torchvision_s']}",
         f"- training time: hetconv {hetconv_s:.1f} s, PyTorch float32 {torch_s:.1f} s (one thread each; not a benchmark)"]
    _common.write_text(os.path.join(args.out, args.name + ".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
