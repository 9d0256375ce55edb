"""torchvision's own resnet18 through hetconv and back: a user file builds
`torchvision.models.resnet18(num_classes=10)` with a 3x3 stem and no max-pool (as the CIFAR
recipes do), hetconv trains it with two workers (`--spawn cpu,cpu`, the peer step, `--parallel
auto`), and exports it; the `.pt2` is loaded by a Python that never imports hetconv and gives
hetconv's logits, and the npz's keys are torchvision's own state_dict keys.

    python bench/torchvision_resnet.py --out bench/results/graph
    python bench/torchvision_resnet.py --torchvision-path /tmp/tv   # an unpacked torchvision wheel

torchvision is not a dependency of hetconv; this needs one that imports beside this torch. Where
the only torchvision at hand was built for another torch build (its compiled ops then fail to
register at import), `--torchvision-path` puts an unpacked wheel first on the path and the user
file leaves out torchvision's compiled-op registrations (resnet18 uses none); the result says so.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

USER_FILE = '''
{preamble}from torch import nn
from torchvision.models import resnet18


def build():
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
'''

# torchvision registers meta kernels for its compiled ops at import; with a wheel built for another
# torch those ops do not exist and the import fails. resnet18 uses none of them.
WITHOUT_COMPILED_OPS = '''import sys
import types
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
'''

# run by a Python that has torch and numpy and never imports hetconv
LOAD_WITHOUT_HETCONV = '''
import sys
import numpy as np
import torch
program = torch.export.load(sys.argv[1]).module()
images = np.load(sys.argv[2])
logits = program(torch.from_numpy(images.astype(np.float32) / 255)).detach().numpy()
np.save(sys.argv[3], logits)
print("hetconv" in sys.modules)
'''


def torchvision_imports(env):
    code = "import torchvision.models as m; m.resnet18(num_classes=10)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "graph"))
    p.add_argument("--name", default="torchvision_resnet18")
    p.add_argument("--torchvision-path", default="", help="a folder holding an unpacked torchvision wheel")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    env = dict(os.environ)
    if args.torchvision_path:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (args.torchvision_path, env.get("PYTHONPATH", "")) if x)
    preamble, how = "", "torchvision imports beside this torch"
    if not torchvision_imports(env):
        preamble, how = WITHOUT_COMPILED_OPS, ("torchvision built for another torch build: the user file leaves out "
                                               "its compiled-op registrations (resnet18 uses none)")
    import numpy as np
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        user = os.path.join(tmp, "myresnet.py")
        with open(user, "w") as f:
            f.write(USER_FILE.format(preamble=preamble))
        ck = os.path.join(tmp, "ck")
        train = [sys.executable, "-m", "hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--net", f"{user}:build",
                 "--data", "synthetic", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                 "--checkpoint-dir", ck, "--eval-batches", "1"]
        log = subprocess.run(train, env=env, capture_output=True, text=True)
        if log.returncode != 0:
            print(log.stdout[-3000:], log.stderr[-3000:], file=sys.stderr)
            return 1
        for fmt, out in (("torch", "m.pt2"), ("npz", "m.npz")):
            subprocess.run([sys.executable, "-m", "hetconv.cli.export", ck, "--format", fmt, "--out",
                            os.path.join(tmp, out)], env=env, check=True, capture_output=True)
        # what hetconv computes, and what the exported program computes without hetconv
        probe = ("import sys, numpy as np\n"
                 "from hetconv.training.trained_model import InProcessModel, load_model\n"
                 "model = load_model(sys.argv[1])\n"
                 "images = np.random.default_rng(0).integers(0, 256, (8,) + tuple(model.spec.input_shape), "
                 "dtype=np.uint8)\n"
                 "np.save(sys.argv[2], images)\n"
                 "np.save(sys.argv[3], InProcessModel(model, threads=1).logits(model.normalize(images)))\n")
        images, ours, theirs = (os.path.join(tmp, n) for n in ("images.npy", "ours.npy", "theirs.npy"))
        subprocess.run([sys.executable, "-c", probe, ck, images, ours], env=env, check=True)
        bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        imported = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_HETCONV, os.path.join(tmp, "m.pt2"), images,
                                   theirs], env=bare, check=True, capture_output=True, text=True).stdout.strip()
        ours, theirs = np.load(ours), np.load(theirs)
        keys_code = (f"{preamble}import sys; sys.path.insert(0, {tmp!r}); import myresnet, json; "
                     f"print(json.dumps(sorted(myresnet.build().state_dict())))")
        want = json.loads(subprocess.run([sys.executable, "-c", keys_code], env=env, check=True, capture_output=True,
                                         text=True).stdout)
        with np.load(os.path.join(tmp, "m.npz")) as z:
            got = sorted(z.files)
        modes = [line for line in log.stdout.splitlines() + log.stderr.splitlines() if "mode" in line.lower()][:6]
    diff = float(np.max(np.abs(ours - theirs)))
    result = {"machine": _common.cpu_model(), "torchvision": how, "steps": args.steps,
              "batch_size": args.batch_size, "max_logit_difference": diff,
              "logits_match_1e-4": bool(np.allclose(ours, theirs, rtol=1e-4, atol=1e-4)),
              "loader_imported_hetconv": imported == "True", "npz_keys": len(got),
              "torchvision_keys": len(want), "keys_are_torchvision_s": set(want) <= set(got),
              "extra_npz_keys": sorted(set(got) - set(want))[:10], "log_lines": modes,
              "wall_s": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    command = _common.recorded_command("torchvision_resnet.py", sys.argv[1:] if argv is None else argv)
    lines = [f"Machine: {result['machine']}. Command: `{command}` ({result['wall_s'] / 60:.1f} min).", "",
             f"torchvision: {how}. The user file builds `torchvision.models.resnet18(num_classes=10)`, its `conv1` "
             f"a 3x3 stride-1 conv and its `maxpool` an `nn.Identity()`; hetconv trains it with `--spawn cpu,cpu` "
             f"(the peer step, `--parallel auto`) for {args.steps} steps of {args.batch_size} synthetic images, then "
             f"exports it.", "",
             f"- the `.pt2`, loaded by a Python that never imports hetconv (imported: {result['loader_imported_hetconv']}), "
             f"against hetconv's own logits on 8 images: largest difference {diff:.2e} "
             f"(within 1e-4: {result['logits_match_1e-4']})",
             f"- the npz holds torchvision's {len(want)} state_dict keys: {result['keys_are_torchvision_s']}"
             + (f" (and {len(got) - len(want)} more: {', '.join(result['extra_npz_keys'])})" if len(got) > len(want)
                else ""),
             "", "The run's plan, as it logged it:", ""] + [f"    {line}" for line in modes]
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["logits_match_1e-4"] and result["keys_are_torchvision_s"] else 1


if __name__ == "__main__":
    sys.exit(main())
