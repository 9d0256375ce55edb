"""How many micro-batches a step is cut into: the one rule, for training and for the planner's
predictions alike."""

MIN_IMAGES_PER_MICRO = 16       # smaller GEMMs lose more efficiency than the overlap gains
MAX_MICRO_BATCHES = 4           # each adds a round of messages per layer


def micro_batch_count(requested, batch_size, exchange, workers):
    """`requested` (--micro-batches) where it is set; auto (0): pieces only where something
    overlaps, the peer exchange over two or more workers, of at least MIN_IMAGES_PER_MICRO
    images and at most MAX_MICRO_BATCHES of them."""
    if requested:
        return requested
    if exchange != "peer" or workers < 2:
        return 1
    return max(1, min(MAX_MICRO_BATCHES, batch_size // MIN_IMAGES_PER_MICRO))
