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
    assert [name for name, _ in picked] == ["hetconv local fp32", "torch fp32", "hetconv local fp32 spinning"]
    assert picked[2][1]["env"] == precision.SPINNING and "env" not in picked[0][1]
    assert [name for name, _ in precision.chosen_configs(",".join(precision.DEFAULT_CONFIGS))] == \
        precision.DEFAULT_CONFIGS
    with pytest.raises(SystemExit, match="--configs 'torch fp64'"):
        precision.chosen_configs("torch fp64")
