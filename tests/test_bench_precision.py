"""bench/precision.py: a network given its own batch (--nets NAME:BATCH) runs and is rendered at
that batch; a bad batch is one line."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import precision  # noqa: E402


def test_nets_take_a_batch_of_their_own():
    assert precision.net_batches("paper,airbench94:256,", 32) == [("paper", 32), ("airbench94", 256)]
    for bad in ("airbench94:0", "airbench94:x", "vgg-small:-3"):
        with pytest.raises(SystemExit, match=f"--nets '{bad}'"):
            precision.net_batches(bad, 32)


def test_the_table_names_a_network_s_own_batch():
    row = {"ok": True, "step_s": 0.5, "step_s_all": [0.5], "loss_first": 2.3, "loss_last": 2.2,
           "foreign_load_cores": 0.0, "round": 0, "conv_paths": []}
    doc = {"title": "", "machine": "m", "isa": "", "blas": "", "gemm": "", "torch": "", "batch_size": 32, "warmup": 1,
           "steps": 1, "nets": ["paper", "airbench94"], "net_batch": {"paper": 32, "airbench94": 256},
           "configs": ["torch fp32"], "peers": {"torch fp32": {}},
           "rows": [dict(row, net=n, config="torch fp32") for n in ("paper", "airbench94")],
           "command": "python bench/precision.py", "wall_s": 1}
    text = precision.markdown(doc)
    assert "## paper\n" in text and "## airbench94, batch 256\n" in text


def test_configs_pick_rows_in_their_own_order_and_refuse_unknown_names():
    picked = precision.chosen_configs("torch fp32,hetconv local fp32 spinning, hetconv local fp32")
    # a PyTorch mode without its layout: its rows in both
    assert [name for name, _ in picked] == ["hetconv local fp32", "torch fp32 (NCHW)", "torch fp32 (channels_last)",
                                            "hetconv local fp32 spinning"]
    assert [what["layout"] for _, what in picked[1:3]] == ["NCHW", "channels_last"]
    assert picked[3][1]["env"] == precision.SPINNING and "env" not in picked[0][1]
    assert [name for name, _ in precision.chosen_configs("torch bf16 autocast (channels_last)")] == [
        "torch bf16 autocast (channels_last)"]
    assert [name for name, _ in precision.chosen_configs(",".join(precision.DEFAULT_CONFIGS))] == \
        precision.DEFAULT_CONFIGS
    with pytest.raises(SystemExit, match="--configs 'torch fp64'"):
        precision.chosen_configs("torch fp64")


def test_every_torch_mode_runs_in_both_layouts_and_is_compared_by_the_faster():
    torch_rows = [name for name in precision.DEFAULT_CONFIGS if name.startswith("torch")]
    assert torch_rows == ["torch fp32 (NCHW)", "torch fp32 (channels_last)", "torch bf16 autocast (NCHW)",
                          "torch bf16 autocast (channels_last)"]
    steps = {"hetconv local fp32": (0.30, 0.32), "hetconv local bf16": (0.20, 0.22), "torch fp32 (NCHW)": (0.40, 0.44),
             "torch fp32 (channels_last)": (0.36, 0.34), "torch bf16 autocast (NCHW)": (0.25, 0.27),
             "torch bf16 autocast (channels_last)": (0.28, 0.30)}
    rows = [{"ok": True, "step_s": s, "step_s_all": [s], "loss_first": 2.3, "loss_last": 2.2, "foreign_load_cores": 0.0,
             "round": rnd, "conv_paths": [], "net": "paper", "config": name}
            for name, per_round in steps.items() for rnd, s in enumerate(per_round)]
    configs = list(steps)
    doc = {"title": "", "machine": "m", "isa": "", "blas": "", "gemm": "", "torch": "", "batch_size": 32, "warmup": 1,
           "steps": 1, "nets": ["paper"], "net_batch": {"paper": 32}, "configs": configs,
           "peers": {name: {k: v for k, v in dict(precision.CONFIGS)[name].items() if k in ("fp32", "torch")}
                     for name in configs},
           "rows": rows, "command": "python bench/precision.py", "wall_s": 1}
    table = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in precision.markdown(doc).splitlines()
             if line.startswith("| ")}
    # hetconv fp32 against torch fp32's faster layout, channels_last: 0.30/0.36 and 0.32/0.34
    assert table["hetconv local fp32"][4] == f"{(0.30 / 0.36 + 0.32 / 0.34) / 2:.2f}"
    # hetconv bf16 against bf16 autocast's faster, NCHW: 0.20/0.25 and 0.22/0.27
    assert table["hetconv local bf16"][4] == f"{(0.20 / 0.25 + 0.22 / 0.27) / 2:.2f}"
    # torch bf16 in either layout against torch fp32's faster layout
    assert table["torch bf16 autocast (NCHW)"][3] == f"{(0.25 / 0.36 + 0.27 / 0.34) / 2:.2f}"
    text = precision.markdown(doc)
    assert ("PyTorch's faster layout, which `x torch` and torch's `x fp32` compare with: torch fp32: channels_last "
            "the faster (0.350 s; NCHW 0.420 s); torch bf16 autocast: NCHW the faster (0.260 s; channels_last "
            "0.290 s).") in text


def test_a_torch_mode_s_rows_name_their_layout_and_the_faster_is_the_one_compared():
    import _torch_twin as T
    assert T.layout_config("torch fp32", "channels_last") == "torch fp32 (channels_last)"
    assert T.layout_of("torch step bf16 autocast (NCHW)") == ("torch step bf16 autocast", "NCHW")
    assert T.layout_of("torch fp32") == ("torch fp32", None)                   # a row saved before: NCHW alone
    medians = {"torch fp32 (NCHW)": 0.4, "torch fp32 (channels_last)": 0.3, "torch step fp32 (NCHW)": 0.1,
               "hetconv local fp32": 0.2}
    assert T.faster_layout(medians, "torch fp32") == "torch fp32 (channels_last)"
    assert T.faster_layout({"torch fp32": 0.4}, "torch fp32") == "torch fp32"
    assert T.faster_layout(medians, "hetconv local fp32") == "hetconv local fp32"
    assert T.faster_layout(medians, "torch bf16 autocast") is None
    assert T.layout_note(medians, "torch fp32") == "torch fp32: channels_last the faster (0.300 s; NCHW 0.400 s)"
    assert T.layout_note({"torch fp32": 0.4}, "torch fp32") == ""
    with pytest.raises(ValueError, match="channels-last"):
        T.layout_config("torch fp32", "channels-last")


def test_channels_last_moves_the_memory_not_the_values():
    torch = pytest.importorskip("torch")
    import _torch_twin as T
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    want = conv(x)
    module, (xl, bias) = T.in_layout(torch, "channels_last", conv, [x, torch.zeros(4)])
    last = torch.channels_last
    assert xl.is_contiguous(memory_format=last) and not x.is_contiguous(memory_format=last)
    assert module.weight.is_contiguous(memory_format=torch.channels_last) and bias.dim() == 1
    torch.testing.assert_close(module(xl), want)
    same, (x2,) = T.in_layout(torch, "NCHW", conv, [x])
    assert same is conv and x2 is x
