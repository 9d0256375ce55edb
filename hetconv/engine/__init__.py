"""What the training loop runs conv layers through: the engine contract, the local engine, the shard
(a worker's conv state and SGD), the planner that splits layers by measured speed, and the cost
model that predicts a step."""
