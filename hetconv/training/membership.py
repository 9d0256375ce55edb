"""What the training loop hears back from a stretch of training: the run ended, a stop was asked
for, or the set of workers changed. Worker loss and joins arrive as these values, handled in one
place in the loop (train.loop), not as exceptions that restart it."""
from dataclasses import dataclass

from hetconv.engine.contract import WorkerLost


@dataclass(frozen=True)
class WorkersLost:
    """Workers stopped answering during a step or anything else that talks to them: the run goes
    on from the last snapshot with the others."""
    error: WorkerLost

    @property
    def workers(self):
        return self.error.workers


@dataclass(frozen=True)
class WorkersJoined:
    """Workers were admitted right after a snapshot, under this new plan."""
    plan: object


@dataclass(frozen=True)
class Finished:
    """The last step is done and saved, and the test set evaluated there."""
    evaluation: object


@dataclass(frozen=True)
class Stopped:
    """A stop was asked for (Ctrl-C, SIGTERM): the step reached is saved where that was asked."""
