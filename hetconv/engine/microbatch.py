"""How many micro-batches a step is cut into: the one rule, for training and for the planner's
predictions alike, and the cost model's pick below the rule's count."""

MIN_IMAGES_PER_MICRO = 16       # smaller GEMMs lose more efficiency than the overlap gains
MAX_MICRO_BATCHES = 4           # each adds a round of messages per layer
FEWER_MICRO_MARGIN = 0.02       # fewer pieces than the rule's only where predicted this much faster


def micro_batch_count(requested, batch_size, exchange, workers):
    """`requested` (--micro-batches) where it is set; auto (0): pieces only where something
    overlaps, the peer exchange over two or more workers, of at least MIN_IMAGES_PER_MICRO
    images and at most MAX_MICRO_BATCHES of them."""
    if requested:
        return requested
    if exchange != "peer" or workers < 2:
        return 1
    return max(1, min(MAX_MICRO_BATCHES, batch_size // MIN_IMAGES_PER_MICRO))


def recorded_micro_batches(value):
    """A micro-batch count read from a file (a metrics record, a checkpoint's meta): an int >= 1,
    else None (missing, a bool, anything else: the rule's count stands)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def cheapest_micro_batches(requested, split, most, predict_s):
    """(count, {count: predicted seconds}) for auto micro-batches: of 1..`most` (the rule's
    count), the one whose predicted step, `predict_s(count)`, is lowest, where it beats the rule's
    own by FEWER_MICRO_MARGIN; else `most`. Pieces overlap the wire with compute, but every piece
    is a call, and a call pays for its kernels whatever its images (the FFT path streams its
    kernel spectra once a call): on a large layer that can cost more than the overlap saves.
    None where the rule's count stands: `requested` (--micro-batches) set by hand, one piece
    anyway, or a `split` other than proportional (the naive baseline keeps the naive count)."""
    if requested or most < 2 or split != "proportional":
        return None
    predicted = {m: float(predict_s(m)) for m in range(1, most + 1)}
    best = min(predicted, key=predicted.get)
    if predicted[best] < (1.0 - FEWER_MICRO_MARGIN) * predicted[most]:
        return best, predicted
    return most, predicted


def priced_text(predicted):
    """{count: seconds} -> "1: 1.074 s, 2: 1.254 s" (keys may be ints or, from a metrics record,
    strings)."""
    return ", ".join(f"{m}: {float(s):.3f} s" for m, s in sorted(predicted.items(), key=lambda kv: int(kv[0])))
