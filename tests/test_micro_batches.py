"""Auto micro-batches: the rule's count, or fewer where the cost model prices fewer faster."""
import pytest

from hetconv.coordinator.remote import RemoteEngine
from hetconv.engine.microbatch import FEWER_MICRO_MARGIN, cheapest_micro_batches, micro_batch_count, priced_text
from hetconv.engine.planner import make_plan
from hetconv.engine.policy import PlanSettings
from hetconv.geometry import conv_specs
from hetconv.training.config import Config

SPECS = conv_specs([8, 16])
SHAPES = [(32, 3, 32, 32), (32, 8, 14, 14)]


def test_fewer_pieces_only_where_priced_faster_by_the_margin():
    prices = {1: 1.0, 2: 0.9, 3: 0.95, 4: 1.1}
    assert cheapest_micro_batches(0, "proportional", 4, prices.get) == (2, prices)
    # within the margin of the rule's own count, the rule's count stands
    near = 1.0 - FEWER_MICRO_MARGIN / 2
    assert cheapest_micro_batches(0, "proportional", 2, {1: near, 2: 1.0}.get)[0] == 2
    assert cheapest_micro_batches(0, "proportional", 2, {1: 1.2, 2: 1.0}.get)[0] == 2
    # no pick: a count set by hand, one piece anyway, the naive split
    assert cheapest_micro_batches(3, "proportional", 3, prices.get) is None
    assert cheapest_micro_batches(0, "proportional", 1, prices.get) is None
    assert cheapest_micro_batches(0, "equal", 4, prices.get) is None
    assert priced_text({"2": 1.2545, "1": 1.0}) == priced_text({2: 1.2545, 1: 1.0}) == "1: 1.000 s, 2: 1.254 s"


def timing(call_per_kernel, per_image_kernel, batch=32):
    """A calibration timing of seconds = call_per_kernel k + images per_image_kernel k, forward
    and backward alike, at the four points calibration times."""
    def t(k, n):
        return call_per_kernel * k + n * per_image_kernel * k
    ks = [16, 8]
    return {"batch": batch, "kernels": ks, "forward_s": [t(k, batch) for k in ks], "backward_s": [t(k, batch) for k in ks],
            "half_batch": {"batch": batch // 2, "kernels": ks, "forward_s": [t(k, batch // 2) for k in ks],
                           "backward_s": [t(k, batch // 2) for k in ks]}}


def engine_with(layer_timing):
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.exchange, engine.wire, engine.micro_choice = "peer", "float32", None
    engine.peers = {"a": None, "b": None}
    engine.log = lambda line: None
    engine.calibration = {w: {"device": "cpu", "description": "", "speeds": [1.0, 1.0],
                              "layers": [layer_timing, layer_timing]} for w in ("a", "b")}
    return engine


@pytest.mark.parametrize("call_per_kernel, link, expected", [
    (2e-3, "10gbit", 1),          # a call's kernels dominate, the wire is short: one piece
    (0.0, "100mbit", 2),          # compute per image only, a slow wire to hide: the rule's two
])
def test_the_coordinator_picks_the_count_its_cost_model_prices_fastest(call_per_kernel, link, expected):
    engine = engine_with(timing(call_per_kernel, 2e-5))
    cfg = Config(conv="8,16", batch_size=32, link=link, parallel="model").validate()
    speeds = {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    plan = engine._plan_from_calibration(SPECS, SHAPES, speeds, PlanSettings.of(cfg))
    assert plan.counts() == make_plan([8, 16], speeds).counts()       # identical workers: an even split
    choice = engine.micro_choice
    assert micro_batch_count(0, 32, "peer", 2) == 2
    assert choice["micro_batches"] == expected and set(choice["predicted_s"]) == {1, 2}
    assert choice["predicted_s"][expected] == min(choice["predicted_s"].values())
    # the run follows it, never above the rule for the workers there are now
    assert engine.run_micro_batches(cfg.micro_batches, cfg.batch_size) == expected
    engine.peers = {"a": None}
    assert engine.run_micro_batches(cfg.micro_batches, cfg.batch_size) == 1
    # a count set by hand is never second-guessed
    engine.peers = {"a": None, "b": None}
    engine._plan_from_calibration(SPECS, SHAPES, speeds, PlanSettings.of(Config(
        conv="8,16", batch_size=32, link=link, parallel="model", micro_batches=2).validate()))
    assert engine.micro_choice is None
    assert engine.run_micro_batches(3, 32) == 3


def test_a_plan_gives_the_cost_model_its_kernels_and_images_per_worker():
    plan = make_plan([8, 16], {"a": [3.0, 1.0], "b": [1.0, 1.0]}, modes=["data", "model"], batch=32)
    assert plan.counts() == {"a": [8, 8], "b": [8, 8]}           # a data layer: every kernel on each
    assert plan.images() == {"a": [24, 0], "b": [8, 0]}
