"""A run does what its flags say: a resume that changes the run's length says what that does to
the learning-rate schedule (laid over the new length: where it ends, the rate where it resumes);
a flag the run would ignore is refused in one line naming it, before any worker starts or any
data loads where it can be; messages name the flags, not the config's fields. In-process and
cheap: the tiny --local runs take a second or two."""
import json
import types

import numpy as np
import pytest

import hetconv
from hetconv.cli import coordinator
from hetconv.training.config import Config, config_from_args
from hetconv.training.loop import resume_lines, resumed_config
from hetconv.training.recipe import Recipe, check_run_length
from hetconv.training.schedule import Schedule

TINY = ["--local", "--conv", "4,8", "--fc", "8", "--threads", "1", "--batch-size", "8", "--synthetic-train", "64",
        "--synthetic-test", "16"]


def data_set(images):
    """What resume_lines reads of a data set: its training labels (how many) and its name."""
    return types.SimpleNamespace(train_y=np.zeros(images, np.int64), name="cifar10")


def checkpoint_meta(step, **saved):
    return {"step": step, "path": "ck/ckpt-step0000120.npz", "config": Config(**saved).validate().to_json()}


def lines_for(meta, given, images=10000, **now):
    cfg, changes = resumed_config(meta, Config(**now), set(given))
    return resume_lines(meta, cfg, changes, data_set(images))


# ---- 1. a resume that changes the run's length --------------------------------------------------

def test_a_shorter_onecycle_run_says_where_its_schedule_now_ends_and_the_rate_it_jumps_to():
    # 10000 images of 128 a step: 78 steps an epoch; 20 epochs are 1560 steps, 3 are 234
    meta = checkpoint_meta(120, epochs=20, schedule="onecycle")
    [line] = lines_for(meta, {"epochs"}, epochs=3)
    then, now = Schedule("onecycle", 0.01, 1560), Schedule("onecycle", 0.01, 234)
    assert line == (f"--epochs 20 -> 3 (given on the command line): the onecycle schedule, laid over the run's new "
                    f"length, now ends at step 234 (was 1560); where it resumes (step 120), the learning rate goes "
                    f"from {then.lr_at(120):.3g} to {now.lr_at(120):.3g} and the momentum from "
                    f"{then.momentum_at(120):.3g} to {now.momentum_at(120):.3g}")
    assert "from 0.00188 to 0.00781 and the momentum from 0.935 to 0.872" in line
    # the run goes on with the schedule laid over its new length: the rate the line names
    cfg, _ = resumed_config(meta, Config(epochs=3), {"epochs"})
    assert Recipe(cfg, 234).rule(120).lr == now.lr_at(120)


def test_adamw_names_beta1_and_a_rate_past_the_checkpoints_end_is_its_last_steps():
    meta = checkpoint_meta(234, epochs=3, schedule="cosine", optimizer="adamw", warmup_steps=10)
    line, schedule = lines_for(meta, {"epochs", "schedule"}, epochs=6, schedule="onecycle")
    assert schedule == "--schedule cosine -> onecycle (given on the command line)"      # said once, on the first
    assert line.startswith("--epochs 3 -> 6 (given on the command line): the onecycle schedule, laid over the "
                           "run's new length, now ends at step 468 (was 234); where it resumes (step 234), the "
                           "learning rate goes from ")
    assert " (its last step's, where the checkpoint's run ended) to " in line and "and beta1 from 0.9 to " in line


def test_a_constant_rate_says_only_where_the_run_ends():
    meta = checkpoint_meta(100, epochs=2, lr=0.1)
    assert lines_for(meta, {"epochs", "lr"}, epochs=4, lr=0.05) == [
        "--epochs 2 -> 4 (given on the command line): the run now ends at step 312 (was 156)",
        "--lr 0.1 -> 0.05 (given on the command line)"]
    # --steps says where the run ends itself
    assert lines_for(meta, {"steps"}, steps=120) == ["--steps 0 -> 120 (given on the command line)"]
    assert lines_for(meta, set()) == []


def test_a_schedule_changed_at_the_same_length_says_the_rate_where_it_resumes():
    meta = checkpoint_meta(300, epochs=20, schedule="cosine")
    [line] = lines_for(meta, {"lr"}, lr=0.1)
    cosine = Schedule("cosine", 0.01, 1560)
    assert line == (f"--lr 0.01 -> 0.1 (given on the command line): where it resumes (step 300), the learning "
                    f"rate goes from {cosine.lr_at(300):.3g} to {10 * cosine.lr_at(300):.3g}")


def test_a_run_shortened_to_before_its_checkpoint_says_nothing_is_trained():
    meta = checkpoint_meta(300, epochs=20, schedule="cosine")
    [line] = lines_for(meta, {"epochs"}, epochs=3)
    assert line == ("--epochs 20 -> 3 (given on the command line): the cosine schedule, laid over the run's new "
                    "length, now ends at step 234 (was 1560); the run's 234 steps end at or before step 300, where "
                    "the checkpoint is: no step is trained, the checkpoint is only evaluated")


def test_the_resume_line_names_the_rate_the_resumed_run_trains_with(tmp_path, capsys):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    assert coordinator.main([*TINY, "--steps", "4", "--schedule", "cosine", "--checkpoint-dir", str(ck)]) == 0
    capsys.readouterr()
    assert coordinator.main([*TINY, "--resume", str(ck), "--steps", "6", "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    then, now = Schedule("cosine", 0.01, 4), Schedule("cosine", 0.01, 6)
    assert (f"--steps 4 -> 6 (given on the command line): the cosine schedule, laid over the run's new length, "
            f"now ends at step 6 (was 4); where it resumes (step 4), the learning rate goes from "
            f"{then.lr_at(3):.3g} (its last step's, where the checkpoint's run ended) to {now.lr_at(4):.3g}") in out
    steps = [r for r in map(json.loads, open(metrics)) if r["event"] == "step"]
    assert [(r["step"], r["lr"]) for r in steps] == [(5, now.lr_at(4)), (6, now.lr_at(5))]


# ---- 2. flags that would change nothing are refused --------------------------------------------

@pytest.mark.parametrize("config,given,message", [
    (dict(betas="0.9,0.99"), {"betas"}, "--betas 0.9,0.99 applies to --optimizer adamw or adam, not sgd"),
    (dict(eps=1e-6), {"eps"}, "--eps 1e-06 applies to --optimizer adamw or adam, not sgd"),
    (dict(optimizer="adamw", momentum=0.8), {"momentum"},
     "--momentum 0.8 applies to --optimizer sgd, not adamw (AdamW's momentum is the beta1 of --betas)"),
    (dict(schedule="onecycle", momentum=0.9), {"momentum"},
     "--momentum 0.9 has no effect with --schedule onecycle: it cycles the momentum from 0.95 to 0.85 and back "
     "(drop --momentum, or use another --schedule)"),
    (dict(schedule="cosine", gamma=0.5), {"gamma"}, "--gamma 0.5 applies to --schedule step, not cosine"),
    (dict(gamma=0.1), {"gamma"}, "--gamma 0.1 applies to --schedule step, not constant"),     # the default, given
    (dict(schedule="onecycle"), {"min_lr"}, "--min-lr 0 applies to --schedule cosine, not onecycle"),
    (dict(weight_decay=0.0, no_decay="bias,norm"), {"no_decay"},
     "--no-decay bias,norm has no effect with --weight-decay 0: no parameter is decayed"),
    (dict(batch_size=16, bn_ghost_batch=16), {"bn_ghost_batch"},
     "--bn-ghost-batch 16 is the whole --batch-size 16: one statistics group, as 0 (the default) makes; give "
     "fewer images per group"),
])
def test_recipe_flags_the_run_would_ignore_are_refused_naming_the_flag(config, given, message):
    cfg = Config(**config).validate()
    with pytest.raises(ValueError) as e:
        cfg.check_given(given)
    assert str(e.value) == message
    assert cfg.check_given(set()) == []           # the same values, not given (a resumed run's own): accepted


@pytest.mark.parametrize("config,given", [
    (dict(optimizer="adamw", betas="0.9,0.99", eps=1e-6), {"optimizer", "betas", "eps"}),
    (dict(momentum=0.8, nesterov=True), {"momentum", "nesterov"}),
    (dict(schedule="step", milestones="5", gamma=0.5), {"schedule", "milestones", "gamma"}),
    (dict(schedule="cosine", min_lr=0.001), {"schedule", "min_lr"}),
    (dict(no_decay="bias,norm"), {"no_decay"}),
    (dict(batch_size=16, bn_ghost_batch=6), {"batch_size", "bn_ghost_batch"}),     # groups of 6, 6 and 4
])
def test_recipe_flags_that_count_are_accepted(config, given):
    assert Config(**config).validate().check_given(given) == []


def test_betas_with_a_onecycle_adamw_run_are_a_note_they_set_beta2_only():
    cfg = Config(optimizer="adamw", schedule="onecycle", betas="0.85,0.99").validate()
    assert cfg.check_given({"betas"}) == ["note: --schedule onecycle cycles AdamW's beta1 from 0.95 to 0.85 and "
                                          "back: --betas 0.85,0.99 sets only its beta2, 0.99"]


def test_min_lr_with_another_schedule_is_refused_by_value_too():
    with pytest.raises(ValueError, match=r"^--min-lr 0.001 applies to --schedule cosine, not onecycle$"):
        Config(schedule="onecycle", min_lr=0.001).validate()


def given_error(*argv):
    """The message prepare's _check_given refuses these flags with, or its notes when it accepts them."""
    argv = [*TINY[1:], *argv]
    args = coordinator.build_parser().parse_args(argv)
    try:
        return coordinator._check_given(args, config_from_args(args), coordinator.given_config_fields(argv))
    except ValueError as e:
        return str(e)


def test_run_flags_the_run_would_ignore_are_refused_naming_the_flag(tmp_path):
    assert given_error("--local", "--keep-checkpoints", "5") == (
        "--keep-checkpoints 5 needs --checkpoint-dir DIR: without it no checkpoint is written")
    assert given_error("--spawn", "cpu,cpu", "--split", "equal", "--rebalance-after", "4") == (
        "--rebalance-after 4 re-splits the work by measured speed; --split equal keeps it equal (drop one of them, "
        "or give --rebalance-after 0)")
    assert given_error("--local", "--keep-checkpoints", "5", "--checkpoint-dir", str(tmp_path)) == []
    assert given_error("--local", "--keep-checkpoints", "5", "--resume", str(tmp_path)) == []
    assert given_error("--spawn", "cpu,cpu", "--rebalance-after", "4") == []
    assert given_error("--spawn", "cpu,cpu", "--split", "equal", "--rebalance-after", "0") == []


def test_threads_for_external_workers_is_a_note_scripts_give_it_to_every_row():
    assert given_error("--workers", "2", "--threads", "1") == [
        "note: --threads 1 is for the devices this run starts (--local, --spawn); the --workers 2 external ones "
        "take their own (hetconv-worker --threads), so it changes nothing here"]
    assert given_error("--spawn", "cpu,cpu", "--threads", "1") == []


def coordinator_says(capsys, *argv):
    code = coordinator.main([*TINY, "--steps", "8", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, out, err.strip()


def test_a_ghost_batch_on_a_network_without_batchnorm_is_refused_before_any_work(capsys):
    code, out, err = coordinator_says(capsys, "--bn-ghost-batch", "4")
    assert code == 2 and not out
    assert err == ("hetconv-coordinator: --bn-ghost-batch 4 groups the images of BatchNorm's statistics; the paper "
                   "family (--conv 4,8 --fc 8) has no BatchNorm layer (drop it, or use a network with one, such as "
                   "--net vgg-small-bn)")
    net = Config(net="vgg-small-bn").network((3, 32, 32), 10)
    coordinator._check_network_flags(Config(net="vgg-small-bn", bn_ghost_batch=4), net, {"bn_ghost_batch"})


def test_the_python_api_refuses_a_keyword_as_its_flag():
    with pytest.raises(ValueError, match=r"^--betas 0.9,0.99 applies to --optimizer adamw or adam, not sgd$"):
        hetconv.train(local=True, conv=[4, 8], fc=[8], steps=1, betas="0.9,0.99")


# ---- 3. messages name the flags -----------------------------------------------------------------

def test_a_warm_up_as_long_as_the_run_names_warmup_steps_before_any_work(capsys):
    code, out, err = coordinator_says(capsys, "--warmup-steps", "8")
    assert code == 2 and err == ("hetconv-coordinator: --warmup-steps 8 leaves --schedule constant no step: the run "
                                 "has 8 steps; give fewer warm-up steps, or more --epochs or --steps")


def test_milestones_past_the_schedule_name_milestones():
    cfg = Config(schedule="step", milestones="3,12", warmup_steps=4).validate()
    with pytest.raises(ValueError) as e:
        check_run_length(cfg, 16)
    assert str(e.value) == ("--milestones 3,12: 12 is past the schedule's last step 11 (milestones count from the "
                            "end of the 4 --warmup-steps of the run's 16 steps); give milestones below 12, or more "
                            "--epochs or --steps")
    with pytest.raises(ValueError, match="^--milestones 3,12: 12 is past"):
        Recipe(cfg, 16)
    Recipe(cfg, 17)
