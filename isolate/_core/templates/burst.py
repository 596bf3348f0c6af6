"""How many episodes of one template run at once: the size of its pool of parked forks when no
caller chose one (``isolate.park``).

An RL step starts its rollouts together, they end, the trainer trains, and the next step starts
as many again. A template keeps as many forks parked as the most of its episodes that ran at
once in its last burst (a burst ends when none of its episodes is running), so that the next
step's rollouts start with a hand-over instead of a fork each. The pool's memory floor, its fd
budget and ``MAX_PARKED`` bound it as they bound any pool.
"""

from __future__ import annotations

__all__ = ["Burst"]


class Burst:
    """The episodes of one template running now, and the most that ran at once in the burst
    going on and in the one before it. Used from the event loop only."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.last_peak = 0

    def began(self) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)

    def ended(self) -> None:
        self.running -= 1
        if self.running <= 0:  # the burst is over: the next is measured afresh
            self.running, self.last_peak, self.peak = 0, self.peak, 0

    def size(self) -> int:
        """How many forks to keep parked: the larger of the last burst and this one so far.
        A burst smaller than the last shrinks the pool only once it is over."""
        return max(self.peak, self.last_peak)
