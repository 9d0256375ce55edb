"""Does a 16-bit wire cost accuracy? Test accuracy after the same training with feature maps and
gradients on the wire as float32, bfloat16 and float16, on two data sets:

- synthetic: hetconv's built-in CIFAR-shaped set;
- digits: a small real set, the 1,797 8x8 handwritten digits that scikit-learn ships (UCI
  optdigits), scaled to 32x32x3 and written in CIFAR-10's python format, so it goes through the
  same loader as CIFAR-10 itself.

    python bench/wire_accuracy.py --out bench/results          # (pip install '.[bench]')

Each run: two spawned CPU workers, --exchange peer, the same seed, network and steps; only
--wire-dtype differs. Accuracy differences are in points (percent of the test set). Writes
OUT/wire_accuracy.json (rows, machine, command, load, wall time) and OUT/wire_accuracy.md.
"""
import argparse
import os
import pickle
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

WIRES = ("float32", "bfloat16", "float16")


def write_digits_as_cifar(directory):
    """scikit-learn's digits -> DIRECTORY/cifar-10-batches-py in the official layout: 5 train
    batches and a test batch (each a pickled dict of uint8 rows R, G, B planes and labels)."""
    import numpy as np
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = np.kron(digits.images, np.ones((4, 4)))                      # (n, 32, 32), values 0..16
    images = np.clip(images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    rows = np.repeat(images.reshape(len(images), 1, 1024), 3, axis=1).reshape(len(images), 3072)
    order = np.random.default_rng(0).permutation(len(rows))
    rows, labels = rows[order], digits.target[order].astype(int)
    n_test = len(rows) // 5
    root = os.path.join(directory, "cifar-10-batches-py")
    os.makedirs(root, exist_ok=True)
    train_rows, train_labels = rows[n_test:], labels[n_test:]
    parts = np.array_split(np.arange(len(train_rows)), 5)
    for i, idx in enumerate(parts):
        with open(os.path.join(root, f"data_batch_{i + 1}"), "wb") as f:
            pickle.dump({b"data": train_rows[idx], b"labels": train_labels[idx].tolist()}, f, protocol=2)
    with open(os.path.join(root, "test_batch"), "wb") as f:
        pickle.dump({b"data": rows[:n_test], b"labels": labels[:n_test].tolist()}, f, protocol=2)
    with open(os.path.join(root, "batches.meta"), "wb") as f:
        pickle.dump({b"label_names": [str(d).encode() for d in range(10)]}, f, protocol=2)
    return root, len(train_rows), n_test


def run(data, wire, seed, args, log):
    from hetconv.training.config import Config
    from hetconv.coordinator.remote import RemoteEngine
    from hetconv.training.loop import train
    cfg = Config(data=data, conv=args.conv, fc=args.fc, batch_size=args.batch_size, epochs=args.epochs,
                 lr=args.lr, seed=seed, threads=1, wire_dtype=wire, exchange="peer",
                 rebalance_after=0, synthetic_train=args.synthetic_train, synthetic_test=args.synthetic_test).validate()
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu", "cpu"], threads=1, log=log, exchange="peer", wire=wire)
    t0 = time.perf_counter()
    try:
        summary = train(cfg, engine, log=log)
    finally:
        engine.close()
    return {"data": data if data == "synthetic" else "digits", "wire": wire, "seed": seed,
            "test_accuracy": summary["test_accuracy"],
            "test_images": summary["test_images"], "final_loss": summary["final_loss"], "steps": summary["step"],
            "wall_s": time.perf_counter() - t0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--conv", default="32,64")
    p.add_argument("--fc", default="64")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seeds", type=int, default=3, help="repeat every run with seeds 0..N-1: one run's accuracy "
                                                       "moves by points with any perturbation of SGD, so the "
                                                       "comparison is of means, against float32's own spread")
    p.add_argument("--synthetic-train", type=int, default=5000)
    p.add_argument("--synthetic-test", type=int, default=1000)
    p.add_argument("--render", default="", help="only rewrite the .md beside this saved wire_accuracy.json")
    args = p.parse_args(argv)
    if args.render:
        import json
        with open(args.render) as f:
            write(os.path.dirname(os.path.abspath(args.render)), json.load(f))
        return 0
    command = "python bench/wire_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    quiet = lambda *_: None   # noqa: E731
    rows = []
    t_all = time.perf_counter()
    load_before = _common.load_average()
    with tempfile.TemporaryDirectory(prefix="hetconv-digits-") as scratch:
        digits, n_train, n_test = write_digits_as_cifar(scratch)
        for data in ("synthetic", digits):
            for seed in range(args.seeds):
                for wire in WIRES:
                    print(f"[{'synthetic' if data == 'synthetic' else 'digits'}] seed {seed}, --wire-dtype {wire} ...",
                          flush=True)
                    row = run(data, wire, seed, args, quiet)
                    rows.append(row)
                    print(f"    test accuracy {row['test_accuracy']:.4f} on {row['test_images']} images, "
                          f"{row['wall_s']:.0f}s", flush=True)
    result = {"machine": _common.cpu_model(), "command": command, "wall_s": time.perf_counter() - t_all,
              "load_before": load_before, "load_after": _common.load_average(),
              "network": {"conv": args.conv, "fc": args.fc, "batch_size": args.batch_size, "epochs": args.epochs,
                          "lr": args.lr, "seeds": args.seeds},
              "digits": {"train": n_train, "test": n_test}, "rows": rows}
    write(args.out, result)
    return 0


def summarize(rows):
    """Per (data, wire): mean test accuracy over seeds, its spread, and the mean difference
    from float32 in points, seed by seed (the same seed: the same start and the same batches)."""
    import numpy as np
    out = []
    for data in dict.fromkeys(r["data"] for r in rows):
        base = {r["seed"]: r["test_accuracy"] for r in rows if r["data"] == data and r["wire"] == "float32"}
        for wire in WIRES:
            acc = {r["seed"]: r["test_accuracy"] for r in rows if r["data"] == data and r["wire"] == wire}
            diffs = [100.0 * (acc[s] - base[s]) for s in acc if s in base]
            out.append({"data": data, "wire": wire, "seeds": len(acc), "mean_accuracy": float(np.mean(list(acc.values()))),
                        "std_points": float(100.0 * np.std(list(acc.values()))),
                        "mean_points_vs_float32": float(np.mean(diffs)) if diffs else float("nan")})
    return out


def render(result):
    net = result["network"]
    lines = [f"Machine: {result['machine']}. Command: `{result['command']}` ({result['wall_s'] / 60:.1f} min; "
             f"{result['load_before']} before, {result['load_after']} after).",
             f"Two CPU workers, --exchange peer, conv {net['conv']}, fc {net['fc']}, batch {net['batch_size']}, "
             f"{net['epochs']} epochs, lr {net['lr']}, seeds 0..{net['seeds'] - 1}; digits: {result['digits']['train']} "
             f"train / {result['digits']['test']} test images.", ""]
    table = [[s["data"], s["wire"], s["seeds"], f"{s['mean_accuracy']:.4f}", f"{s['std_points']:.2f}",
              f"{s['mean_points_vs_float32']:+.2f}"] for s in summarize(result["rows"])]
    lines.append(_common.markdown_table(["data", "wire", "runs", "mean test accuracy", "spread over seeds (std, points)",
                                         "mean points vs float32 (same seed)"], table))
    lines += ["", "Every run:", ""]
    lines.append(_common.markdown_table(["data", "wire", "seed", "test accuracy", "final loss", "steps"],
                                        [[r["data"], r["wire"], r["seed"], f"{r['test_accuracy']:.4f}",
                                          f"{r['final_loss']:.4f}", r["steps"]] for r in result["rows"]]))
    return "\n".join(lines)


def write(out_dir, result):
    import json
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "wire_accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = render(result)
    with open(os.path.join(out_dir, "wire_accuracy.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    sys.exit(main())
