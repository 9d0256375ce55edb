"""The peer exchange's bookkeeping on one worker, without sockets: what arrives early is kept for
its step, what belongs to no step it runs is dropped."""
import queue

import numpy as np
import pytest

from hetconv.transport import protocol as P
from hetconv.worker.peers import PeerLinks


def slice_msg(step, phase="gather", layer=0, micro=0, sender="w0", value=1.0):
    return P.unpack(P.pack("SLICE", 0, [np.full((2, 3, 4, 4), value, np.float32)], step=step, phase=phase,
                           layer=layer, micro=micro, sender=sender))


def plan_fields(workers=("w0", "w1", "w2", "w3"), layers=2, you="w1"):
    """PEERS for a plan of `workers` over `layers` conv layers, one kernel each, not connecting:
    what a PeerLinks needs to know to check a slice, without sockets."""
    return {"you": you, "peers": [{"name": w, "endpoints": [], "host_key": ""} for w in workers],
            "ranges": [{w: [i, i + 1] for i, w in enumerate(workers)} for _ in range(layers)],
            "timeout": 2.0, "connect": False}  # a missing message fails the test in 2 s instead of hanging it


@pytest.fixture
def links():
    links = PeerLinks(None, "w1", None, queue.Queue(), None)
    links.connect(plan_fields())
    return links


def test_a_peers_slice_that_overtakes_the_step_message_is_kept_for_that_step(links):
    """A faster peer already in step 7 sends its part of the images' gather before this worker has
    read STEP 7 (they come over different connections): the compute loop holds it, and step 7
    finds it."""
    links.hold_early(slice_msg(7, value=3.0))
    links.start_step(7, 1)
    got = links._await({(7, "gather", 0, 0, "w0")}, 7)
    np.testing.assert_array_equal(got[(7, "gather", 0, 0, "w0")], 3.0)


def test_what_was_held_for_another_step_is_dropped_when_a_step_starts(links):
    links.hold_early(slice_msg(3))                           # an abandoned step's
    links.hold_early(slice_msg(7, sender="w2"))
    links.start_step(7, 1)
    assert list(links.held) == [(7, "gather", 0, 0, "w2")]
    with pytest.raises(TimeoutError, match=r"step 7: waited 2s for \[\(7, 'gather', 0, 0, 'w0'\)\]"):
        links._await({(7, "gather", 0, 0, "w0")}, 7)


def test_messages_arriving_during_a_step_are_matched_or_held(links):
    links.start_step(4, 1)
    links.requests.put(slice_msg(4, phase="gather", layer=1, value=2.0))
    links.requests.put(slice_msg(4, value=1.0))
    got = links._await({(4, "gather", 0, 0, "w0")}, 4)
    np.testing.assert_array_equal(got[(4, "gather", 0, 0, "w0")], 1.0)
    assert list(links.held) == [(4, "gather", 1, 0, "w0")]    # a later tensor's, waiting for its turn


def test_between_steps_only_each_senders_newest_steps_slices_are_held(links):
    """Whatever a peer sends between steps (before any step of the plan tells which comes next),
    what is held stays one step's worth per sender: slices for many steps keep only the newest
    step's, an older step's arriving after it is not kept, and one sender's steps never evict
    another's. The step that starts keeps only its own."""
    for step in range(100, 200):
        links.hold_early(slice_msg(step, sender="w0"))
    links.hold_early(slice_msg(199, sender="w2", value=5.0))
    links.hold_early(slice_msg(150, sender="w0"))                # overtaken: an older step's
    links.hold_early(slice_msg(150, sender="w3"))                # w3's newest: kept until a step starts
    links.hold_early(slice_msg("7", sender="w2"))                # not a step number
    assert sorted(links.held) == [(150, "gather", 0, 0, "w3"), (199, "gather", 0, 0, "w0"),
                                  (199, "gather", 0, 0, "w2")]
    links.start_step(199, 1)
    assert sorted(links.held) == [(199, "gather", 0, 0, "w0"), (199, "gather", 0, 0, "w2")]
    got = links._await({(199, "gather", 0, 0, "w2")}, 199)
    np.testing.assert_array_equal(got[(199, "gather", 0, 0, "w2")], 5.0)


def test_what_a_peer_sends_ahead_is_bounded_by_the_plans_micro_batches_and_a_byte_budget():
    """A peer may send its next step's slices before this worker starts that step; it can hold
    them for no more micro-batches than a step of the plan has (PEERS' micro_batches) and no more
    bytes per sender than PEERS' early_bytes, between steps and during one alike. Another
    sender's budget is its own."""
    one = slice_msg(0).arrays[0].nbytes                          # 384 bytes a slice
    links = PeerLinks(None, "w1", None, queue.Queue(), None, log=lambda line: None)
    links.connect({**plan_fields(), "micro_batches": 4, "early_bytes": 3 * one})
    for m in range(8):
        links.hold_early(slice_msg(9, micro=m, sender="w0"))
    links.hold_early(slice_msg(9, micro=0, sender="w2"))
    assert sorted(k[3] for k in links.held if k[4] == "w0") == [0, 1, 2]      # 4 and up: no such micro-batch;
    assert (9, "gather", 0, 0, "w2") in links.held                             # 3: over w0's budget
    # during step 9, the same bounds for step 10's
    links.start_step(9, 4)
    for m in range(6):
        links.requests.put(slice_msg(10, micro=m, sender="w2"))
    links.requests.put(slice_msg(9, micro=1, sender="w2"))
    links._await({(9, "gather", 0, 1, "w2")}, 9)
    assert sorted(k[3] for k in links.held if k[0] == 10) == [0, 1, 2]
    assert links.dropped == 8


@pytest.mark.parametrize("field,value", [("micro_batches", 0), ("micro_batches", "4"),
                                         ("early_bytes", 0), ("early_bytes", 1.5)])
def test_peers_bounds_of_the_wrong_kind_are_refused(field, value):
    links = PeerLinks(None, "w1", None, queue.Queue(), None)
    with pytest.raises(ValueError, match=f"PEERS {field}"):
        links.connect({**plan_fields(), field: value})


def test_a_batchnorm_barrier_is_counted_as_waiting_not_as_the_blocks_compute():
    """A data block's BatchNorm sums wait for the slowest worker. That wait is not this worker's
    compute: counted as compute, a fast worker would look as slow as the peer it waits for, and a
    re-split from measured steps could not see which is slower."""
    import threading
    import time
    from types import SimpleNamespace

    from hetconv.worker.graph_step import LayoutBlocks
    links = PeerLinks(None, "w1", None, queue.Queue(), None)
    fields = plan_fields(workers=("w0", "w1"), layers=1)
    links.connect({**fields, "ranges": [{"w0": [0, 2], "w1": [0, 2]}], "modes": ["data"],
                   "images": [{"w0": 2, "w1": 2}]})
    links._send_peer = lambda *args, **kwargs: None          # no sockets: the peer's sums come from a thread
    delay = 0.4
    reducing = threading.Event()

    class OneBatchNorm:
        device = SimpleNamespace(synchronize=lambda: None)
        layers = {0: SimpleNamespace(spec=SimpleNamespace(tail=["batchnorm"]))}

        def forward_layer(self, layer, inputs, train, reduce, emit, dropout, batch):
            for m, x, _ in inputs:
                reducing.set()
                sums, counts = reduce(("bn_forward", 0), np.ones((2, 3)), np.array([2]))
                emit(m, x + sums[0, 0])

    def slow_peer():                 # its sums come `delay` after this worker reached the barrier
        reducing.wait(10)
        time.sleep(delay)
        links.requests.put(P.unpack(P.pack("SLICE", 0, [np.array([1.0] * 6 + [2.0])], step=5, phase="bn_forward",
                                           layer=0, micro=0, sender="w0")))

    links.shard = OneBatchNorm()
    links.start_step(5, 1)
    threading.Thread(target=slow_peer, daemon=True).start()
    compute = [0.0]
    blocks = LayoutBlocks(links, 5, [4], {"w0": [(0, 2)], "w1": [(2, 4)]}, {-1: "rows", 0: "rows"}, "float32", None,
                          compute, None)
    out = blocks.forward_layer(0, [np.zeros((2, 3, 1, 1), np.float32)], True)
    np.testing.assert_array_equal(out[0], 2.0)                 # both workers' sums: 1 + 1
    assert compute[0] < delay / 2, compute                     # the block itself computes next to nothing
    assert links.wait_s >= delay


def test_a_step_receives_each_micro_batch_once_when_its_reader_first_takes_it():
    """worker.graph_step.ArrivingParts: nothing is received before it is read, each micro-batch
    once (in the order readers take them), the time spent receiving goes on the clock a block's
    compute leaves out, and a micro-batch the step does not have is an IndexError."""
    import time

    from hetconv.worker.graph_step import ArrivingParts
    fetched, clock = [], [0.0]

    def fetch(m):
        fetched.append(m)
        time.sleep(0.01)
        return m * 10

    parts = ArrivingParts(3, fetch, clock)
    assert len(parts) == 3 and fetched == [] and clock[0] == 0.0
    assert parts[1] == 10 and fetched == [1]
    assert list(parts) == [0, 10, 20] and fetched == [1, 0, 2]
    assert parts[1] == 10 and fetched == [1, 0, 2]
    assert clock[0] >= 0.03
    for m in (3, -1):
        with pytest.raises(IndexError, match="of 3"):
            parts[m]
