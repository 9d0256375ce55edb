"""Does hetconv train a BatchNorm network as well as PyTorch? Test accuracy after the same training
of `vgg-small-bn` on the real handwritten digits, by hetconv with two spawned one-thread CPU workers
and by PyTorch in one process, for several seeds.

    python bench/accuracy.py --out bench/results/bn                 # 3 seeds, ~10 min on 2 cores
    python bench/accuracy.py --render bench/results/bn/accuracy.json # rewrite accuracy.md from the JSON only

Per seed, both sides start from the same weights and see the same batches:
- the weights are hetconv's own start for that seed (conv weights, then the head's, drawn as
  `hetconv-coordinator --seed S` draws them; BatchNorms at PyTorch's defaults), handed to hetconv's
  training as its starting network and to PyTorch through hetconv.net.torch_import.to_torch;
- the batches are hetconv.data.batches with the loop's order for each epoch (numpy's generator
  seeded by (seed, epoch)), the test set is hetconv.data.test_batches;
- the recipe is the same: SGD with momentum, weight decay on weights (BatchNorm's scale included)
  and none on biases (hetconv's default --no-decay bias), the rate constant or annealed to 0 on a
  cosine over every step (default; PyTorch's CosineAnnealingLR stepped per update). The head's
  Dropout(0.5) draws its masks from each framework's own generator (hetconv's from the seed and step, PyTorch's
  from torch.manual_seed(seed)): the one random stream the two runs do not share.
hetconv's parallel modes are its own choice (--parallel auto); the plan of each run is recorded.
Both sides evaluate every epoch, BatchNorm on its running statistics (PyTorch's module.eval()).
Before training, the two starts are compared on the test set (largest logit difference).

Writes OUT/accuracy.json (every run's per-epoch test accuracy, the plan, the machine, the load)
and OUT/accuracy.md, rendered from the JSON alone.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import _torch_twin  # noqa: E402
from _speedup_common import ForeignLoad  # noqa: E402



def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_digits_run_flags(p, net="vgg-small-bn@0.5", lr=0.05,
                                 spawn_help="hetconv's workers, as hetconv-coordinator --spawn")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="cosine",
                   help="hetconv's --schedule; PyTorch: no scheduler, or CosineAnnealingLR over every step")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch.set_num_threads for the PyTorch runs (one: the shared host's cores are not idle)")
    p.add_argument("--margin", type=float, default=1.0,
                   help="the target: hetconv's median at least PyTorch's median minus this many points")
    p.add_argument("--out", default="", help="folder for accuracy.json and .md (default: print only)")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved accuracy.json")
    return p.parse_args(argv)


def make_config(args, seed, metrics=""):
    from hetconv.training.config import Config
    return Config(data=args.data, net=args.net, batch_size=args.batch_size, epochs=args.epochs, lr=args.lr,
                  momentum=args.momentum, weight_decay=args.weight_decay, schedule=args.schedule, seed=seed,
                  metrics=metrics).validate()


def check_same_start(spec, conv, fc, module, ds, batch_size):
    """The largest |logit| difference on the test set between hetconv's network at these weights
    (in this process, one CPU device) and the PyTorch module made from them, both in inference."""
    import numpy as np
    import torch
    from hetconv.data import test_batches
    from hetconv.devices import open_device
    from hetconv.devices.cpu import HostArrays
    from hetconv.engine.graph import graph_pass
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.planner import fixed_plan
    from hetconv.engine.shard import ConvShard
    from hetconv.geometry import ConvSpec
    from hetconv.net.head import Network
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    engine = LocalEngine({"local": ConvShard(open_device("cpu", threads=1))})
    engine.load(fixed_plan([s.kernels for s in specs], {"local": [s.kernels for s in specs]}), specs,
                [{k: np.array(v, copy=True) for k, v in state.items()} for state in conv])
    engine.configure(graph_pass(spec, HostArrays()))
    head = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
    net = Network(specs, head, engine, None, spec.feature_shape(), fc_params=fc, host=HostArrays())
    module.eval()
    worst = 0.0
    with torch.no_grad():
        for x, _ in test_batches(ds, batch_size):
            worst = max(worst, float(np.abs(net.predict(x) - module(torch.from_numpy(x)).numpy()).max()))
    return worst


def run_hetconv(args, seed, ds, loaded, scratch):
    """hetconv's training with --spawn's workers, from `loaded`'s weights; -> a row."""
    metrics = os.path.join(scratch, f"hetconv-seed{seed}.jsonl")
    cfg = make_config(args, seed, metrics)
    summary, wall, evals, plan, steps = _common.train_on_spawned_workers(cfg, args.spawn, dataset=ds, network=loaded)
    return {"framework": "hetconv", "seed": seed, "test_accuracy": summary["test_accuracy"],
            "test_loss": summary["test_loss"], "test_images": summary["test_images"],
            "final_loss": summary["final_loss"], "steps": summary["step"],
            "epoch_accuracy": [r["test_accuracy"] for r in evals],
            "modes": [layer["mode"] for layer in plan["layers"]], "workers": plan["workers"],
            "median_step_s": statistics.median(r["step_s"] for r in steps), "wall_s": wall}


def run_torch(args, seed, ds, module):
    """The same recipe in PyTorch on `module` (which is trained in place); -> a row."""
    import numpy as np
    import torch
    from hetconv.data import batches, test_batches
    cfg = make_config(args, seed)
    torch.manual_seed(seed)                       # the head's dropout masks
    opt = _torch_twin.sgd(torch, module, cfg)
    steps_per_epoch = len(ds.train_y) // cfg.batch_size
    # stepped after every update, as hetconv's schedule counts updates (hetconv.training.schedule)
    scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * steps_per_epoch)
                 if cfg.schedule == "cosine" else None)
    epoch_accuracy, step_s, loss = [], [], None
    t0 = time.perf_counter()
    for epoch in range(cfg.epochs):
        module.train()
        order = np.random.default_rng([cfg.seed, epoch])       # the training loop's order for this epoch
        for x, y in batches(ds, cfg.batch_size, order):
            t_step = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            step_s.append(time.perf_counter() - t_step)
        epoch_accuracy.append(evaluate(module, ds, cfg.batch_size, test_batches)[0])
    accuracy, test_loss, seen = evaluate(module, ds, cfg.batch_size, test_batches)
    return {"framework": "pytorch", "seed": seed, "test_accuracy": accuracy, "test_loss": test_loss,
            "test_images": seen, "final_loss": float(loss.item()), "steps": cfg.epochs * steps_per_epoch,
            "epoch_accuracy": epoch_accuracy, "median_step_s": statistics.median(step_s),
            "wall_s": time.perf_counter() - t0}


def evaluate(module, ds, batch_size, test_batches):
    """(accuracy, mean cross-entropy, images) on the test set, BatchNorm on its running statistics."""
    import torch
    module.eval()
    correct = seen = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in test_batches(ds, batch_size):
            logits = module(torch.from_numpy(x)).double()
            correct += int((logits.argmax(1).numpy() == y).sum())
            loss += float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="sum"))
            seen += len(y)
    return correct / seen, loss / seen, seen


def summarize(doc):
    """Per framework: the median accuracy over seeds; the difference hetconv - PyTorch in points,
    of the medians and seed by seed; whether the target holds."""
    acc = {fw: {r["seed"]: r["test_accuracy"] for r in doc["rows"] if r["framework"] == fw}
           for fw in ("hetconv", "pytorch")}
    med = {fw: statistics.median(a.values()) for fw, a in acc.items() if a}
    out = {"median": med, "median_test_loss": {fw: statistics.median(r["test_loss"] for r in doc["rows"]
                                                                   if r["framework"] == fw) for fw in med}}
    if len(med) == 2:
        out["median_points"] = 100.0 * (med["hetconv"] - med["pytorch"])
        out["per_seed_points"] = {s: 100.0 * (acc["hetconv"][s] - acc["pytorch"][s])
                                  for s in acc["hetconv"] if s in acc["pytorch"]}
        out["target_met"] = out["median_points"] >= -doc["margin"]
    return out


def markdown(doc):
    r = doc["recipe"]
    s = summarize(doc)
    lines = _common.run_header(doc)
    lines += [f"ISA: {doc['isa']}. BLAS: {doc['blas']}. PyTorch: {doc['torch']}.", "",
              f"`--net {r['net']}` on `{r['data']}` ({doc['data']}), batch {r['batch_size']}, {r['epochs']} epochs "
              f"({r['steps']} steps), SGD lr {r['lr']:g} momentum {r['momentum']:g}, weight decay "
              f"{r['weight_decay']:g} except biases, {r['schedule']} learning rate. hetconv: `--spawn {r['spawn']}` "
              f"(`--parallel auto`; modes below), the training loop in this process. PyTorch: the same "
              f"network as a PyTorch module (hetconv.net.torch_import.to_torch) from the same start, the same batches, "
              f"torch.set_num_threads({r['torch_threads']}). Each seed's two starts differ on the test set by at "
              f"most {max(doc['start_logit_diff'].values()):.1e} in a logit. The head's dropout masks are each "
              f"framework's own.", ""]
    if "median_points" in s:
        verdict = "met" if s["target_met"] else "missed"
        lines += [f"**Median test accuracy over {len(doc['seeds'])} seeds: hetconv "
                  f"{100 * s['median']['hetconv']:.2f}%, PyTorch {100 * s['median']['pytorch']:.2f}%: "
                  f"{s['median_points']:+.2f} points** (target: at least -{doc['margin']:g}; {verdict}). One test "
                  f"image is {100 / doc['rows'][0]['test_images']:.2f} points. Median test loss: hetconv "
                  f"{s['median_test_loss']['hetconv']:.4f}, PyTorch "
                  f"{s['median_test_loss']['pytorch']:.4f}.", ""]
    table = []
    for row in doc["rows"]:
        table.append([row["framework"], row["seed"], f"{100 * row['test_accuracy']:.2f}",
                      " ".join(f"{100 * a:.1f}" for a in row["epoch_accuracy"]), f"{row['test_loss']:.4f}",
                      f"{row['final_loss']:.4f}", "".join(m[0].upper() for m in row.get("modes", [])) or "-",
                      f"{1e3 * row['median_step_s']:.0f}", f"{row['wall_s']:.0f}",
                      f"{row['foreign_load_cores']:.2f}"])
    lines.append(_common.markdown_table(
        ["framework", "seed", "test accuracy %", "after each epoch %", "test loss", "last training loss",
         "modes (M model, D data)", "median step ms", "wall s", "foreign load (cores)"], table))
    if "per_seed_points" in s:
        lines += ["", "hetconv - PyTorch, seed by seed (points): "
                  + ", ".join(f"seed {k}: {v:+.2f}" for k, v in s["per_seed_points"].items()) + "."]
    lines += ["", f"A step is timed as each side's training step (hetconv: `--spawn {r['spawn']}` and the "
              f"coordinator's head; PyTorch: torch.set_num_threads({r['torch_threads']}) in one process), on a "
              f"shared host, one run after the other: not a speed comparison (bench/airbench.py makes one). "
              f"Foreign load: cores' worth of CPU that other processes used while the run went."]
    return "\n".join(lines)


def main(argv):
    args = parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, 'accuracy', markdown)}")
        return 0
    started, load_start = time.time(), _common.load_average()
    import torch
    from hetconv.data import load_dataset
    from hetconv.net import LoadedNet
    from hetconv.net.torch_import import to_torch
    from hetconv.training.loop import network_for
    torch.set_num_threads(args.torch_threads)
    doc = {"recipe": {"net": args.net, "data": _common.relative_path(args.data), "spawn": args.spawn,
                      "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "momentum": args.momentum,
                      "weight_decay": args.weight_decay, "schedule": args.schedule,
                      "torch_threads": args.torch_threads},
           "margin": args.margin, "seeds": list(range(args.seeds)), "rows": [], "start_logit_diff": {}}
    with tempfile.TemporaryDirectory(prefix="hetconv-accuracy-") as scratch:
        for seed in range(args.seeds):
            cfg = make_config(args, seed)
            ds = load_dataset(cfg.data, seed=seed)
            spec = network_for(cfg, ds).spec
            conv, fc = _torch_twin.initial_weights(cfg, spec)
            doc["data"] = repr(ds)
            doc["recipe"]["steps"] = cfg.epochs * (len(ds.train_y) // cfg.batch_size)
            module = to_torch(spec, conv, fc)
            doc["start_logit_diff"][seed] = check_same_start(spec, conv, fc, module, ds, cfg.batch_size)
            for run in ("hetconv", "pytorch"):
                print(f"[seed {seed}] {run} ... ({_common.load_average()})", flush=True)
                with ForeignLoad() as load:
                    row = (run_hetconv(args, seed, ds, LoadedNet(spec, _torch_twin.copied(conv, fc)), scratch)
                           if run == "hetconv" else run_torch(args, seed, ds, module))
                row.update(foreign_load_cores=load.cores, load_after=_common.load_average())
                doc["rows"].append(row)
                print(f"    test accuracy {row['test_accuracy']:.4f} (by epoch "
                      f"{', '.join(f'{a:.3f}' for a in row['epoch_accuracy'])}), {row['wall_s']:.0f} s", flush=True)
    doc.update(_common.run_facts("accuracy.py", argv, started, load_start), torch="; ".join(_common.torch_info(torch)))
    _common.save_or_print(args.out, "accuracy", doc, markdown)
    return 0


if __name__ == "__main__":
    print(_common.reexec_without_blas_overrides())
    sys.exit(main(sys.argv[1:]))
