"""The waiting queue, and whom a preemption takes, by scheduling policy (vLLM's
``--scheduling-policy``).

``fcfs``: arrival order; a preempted sequence goes back to the head; a preemption takes the
most recently admitted running sequence.

``priority``: the request's ``priority`` first (lower runs first, vLLM's field), then arrival;
a preempted sequence goes back to its place in that order; a preemption takes the running
sequence that comes last in it (the one asking for a block, if that is it); and when ``max_num_seqs`` sequences run, a
waiting one of a strictly higher priority than the lowest running takes its place (``outranked``), so that a
flood of low-priority requests never keeps a high-priority one waiting for a slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from spyre_serve.server.sched.sequence import Sequence

POLICIES = ("fcfs", "priority")


def rank(seq: Sequence) -> tuple[int, float, int]:
    """Where ``seq`` stands under ``priority``: lower first."""
    return seq.params.priority, seq.arrival, seq.seq_id


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._q: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)

    def __getitem__(self, i: int) -> Sequence:
        return self._q[i]

    def remove(self, seq: Sequence) -> None:
        self._q.remove(seq)

    def popleft(self) -> Sequence:
        return self._q.popleft()

    def push(self, seq: Sequence) -> None:
        """A new sequence: last (fcfs), or at its rank (priority)."""
        if self.policy == "fcfs":
            self._q.append(seq)
        else:
            self._insert(seq)

    def push_preempted(self, seq: Sequence) -> None:
        """A preempted sequence: first (fcfs), or back at its rank (priority)."""
        if self.policy == "fcfs":
            self._q.appendleft(seq)
        else:
            self._insert(seq)

    def _insert(self, seq: Sequence) -> None:
        r, i = rank(seq), len(self._q)
        while i > 0 and rank(self._q[i - 1]) > r:   # new arrivals land at or near the end
            i -= 1
        self._q.insert(i, seq)

    def victim(self, running: list[Sequence], asking: Sequence,
               spared: Callable[[Sequence], bool]) -> Sequence | None:
        """The running sequence a preemption for ``asking`` (which needs a block) takes, among
        those not ``spared``: under fcfs never ``asking`` itself (None when no other is left),
        under priority the last by rank, ``asking`` itself when that is it (vLLM's)."""
        if self.policy == "fcfs":
            candidates = [s for s in running if s is not asking and not spared(s)]
            return candidates[-1] if candidates else None
        candidates = [s for s in running if s is asking or not spared(s)]
        return max(candidates, key=rank)

    def outranked(self, running: list[Sequence]) -> Sequence | None:
        """Under ``priority``, the running sequence the head of the queue should replace (its
        priority is strictly lower than the head's); None otherwise."""
        if self.policy == "fcfs" or not self._q or not running:
            return None
        last = max(running, key=rank)
        return last if self._q[0].params.priority < last.params.priority else None
