"""What the gradient shards hold between optimizer steps: nothing, the micro-batches' gradients, or gradients a
backward that raised left mixed into earlier micro-batches'.

[Note: a backward that raised]
A backward that raises has already added part of its gradients into the gradient shards: with one rank every gradient
goes straight into its shard, with several every group completed before the error was reduce-scattered into its shard
(what was still bucketed or in flight is dropped: ``GradReducer.abandon``). Where no earlier micro-batch gave gradients
since the last step, those partial gradients are all the shards hold, and the engine drops them (``zero_grad``, which
also rolls back early steps): the next backward starts clean, as if the failed one never ran. Where earlier
micro-batches did, the partial gradients cannot be told from theirs, and ``step()`` refuses until ``zero_grad()`` drops
them all: training on them would train on part of a batch.
"""

from __future__ import annotations

import enum

from zinf.errors import ZinfError

__all__ = ["Accumulation", "GradsHeld"]


class GradsHeld(enum.Enum):
    NONE = "none"  # no backward since the last step or zero_grad
    ACCUMULATED = "accumulated"  # one or more backwards' gradients
    MIXED = "mixed"  # a backward raised after earlier micro-batches' gradients: only zero_grad() leaves this
    UNKNOWN = "unknown"  # dropping a raised backward's gradients raised too: only zero_grad() leaves this


class Accumulation:
    """The engine's gradients between steps (one ``GradsHeld``; see [Note: a backward that raised]), and whether they
    were unscaled and clipped."""

    def __init__(self) -> None:
        self.state = GradsHeld.NONE
        self.backwards = 0  # backwards begun (a module's backward ran), counted for ``backward_raised``
        self.unscaled = False  # the loss scale was taken off the gradients
        self.clipped = False  # clipped by an explicit call: the step does not clip again

    @property
    def has_grads(self) -> bool:
        return self.state is not GradsHeld.NONE

    def begin_backward(self) -> None:
        self.backwards += 1
        if self.state is GradsHeld.NONE:
            self.state = GradsHeld.ACCUMULATED

    def snapshot(self) -> tuple[bool, int]:
        """Before a backward: whether gradients are held, and how many backwards began."""
        return self.has_grads, self.backwards

    def backward_raised(self, before: tuple[bool, int]) -> bool:
        """A backward raised (``before``: ``snapshot()`` as it was called). True: the shards hold its partial
        gradients only, for the caller to drop. One that raised before any module's backward began added nothing."""
        earlier, began = before
        if self.backwards == began:
            return False
        if earlier:
            self.state = GradsHeld.MIXED
        return not earlier

    def mark_unknown(self) -> None:
        """Dropping a raised backward's partial gradients raised as well: what the shards hold is unknown."""
        self.state = GradsHeld.UNKNOWN

    def mark_unscaled(self) -> None:
        self.unscaled = True

    def mark_clipped(self) -> None:
        self.clipped = True

    def check_step(self) -> None:
        if self.state is GradsHeld.MIXED:
            raise ZinfError("zinf: a backward raised after earlier micro-batches had accumulated gradients since the "
                            "last step, and the part of its gradients already added is mixed into theirs; step() would "
                            "train on part of a batch. Call zero_grad() (the engine's, or the optimizer's under a "
                            "front end) to drop the accumulated gradients, then run the micro-batches again ([Note: a "
                            "backward that raised] in zinf/update/accumulation.py).")
        if self.state is GradsHeld.UNKNOWN:
            raise ZinfError("zinf: a backward raised, and dropping the part of its gradients already added raised too "
                            "(logged with the backward's error), so what the gradient shards hold is unknown; step() "
                            "would train on it. Call zero_grad() (the engine's, or the optimizer's under a front end), "
                            "then run the micro-batches again.")

    def clear(self) -> None:
        """A step or a zero_grad left the gradient shards empty."""
        self.state = GradsHeld.NONE
        self.unscaled = self.clipped = False
