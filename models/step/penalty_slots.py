"""Which row of the card's penalty tables each sequence with penalties owns (and, alike, which
slot of a hybrid model's Mamba-2 states each sequence owns: ``StateSlots``).

The step program keeps, per slot, how many times each token was generated and which tokens
the prompt holds (WORKSPACE `pen_output_counts`, `pen_prompt_mask`); the device fills them
from the tokens each step computes (device/kernels/sampling/penalties.py `count_tokens`), so the host
sends one slot number per sequence and step, never its token history. A sequence gets a slot
at its first chunk, which starts at position 0 (the device clears the slot there, whoever
held it before: launches run in order on one stream), and keeps it until `forget`.

    slots = PenaltySlots(64)
    slots.assign(work)      # seq_id -> slot of every work item with penalties
    slots.forget(seq_id)    # when the sequence ends, is preempted or aborted
"""

from __future__ import annotations

from spyre_serve.models.step.interface import SeqWork, SeqWorkError


class PenaltySlots:
    what = "penalty"     # the state a slot holds, in errors

    @staticmethod
    def wants(w: SeqWork) -> bool:
        """Whether a work item needs a slot."""
        return w.sampling.uses_penalties

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # pop() gives the lowest first
        self._slot: dict[int, int] = {}                  # seq_id -> slot

    def __len__(self) -> int:
        """Slots held."""
        return len(self._slot)

    def assign(self, work: list[SeqWork]) -> dict[int, int]:
        """The slot of every work item whose sampling has penalties, given out on the first
        chunk; SeqWorkError naming the items that cannot have one."""
        bad: dict[int, str] = {}
        out: dict[int, int] = {}
        for w in work:
            if not self.wants(w):
                continue
            slot = self._slot.get(w.seq_id)
            if slot is None:
                if w.start_pos != 0:
                    bad[w.seq_id] = (f"seq {w.seq_id}: its {self.what} state starts at position "
                                     f"0, but it holds no {self.what} slot and this chunk starts "
                                     f"at {w.start_pos}")
                    continue
                if not self._free:
                    bad[w.seq_id] = f"seq {w.seq_id}: all {self.num_slots} {self.what} slots are held"
                    continue
                slot = self._slot[w.seq_id] = self._free.pop()
            out[w.seq_id] = slot
        if bad:
            raise SeqWorkError(bad)
        return out

    def forget(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)


class StateSlots(PenaltySlots):
    """A hybrid model's: which slot of the Mamba-2 layers' conv and SSM states each sequence
    owns (every sequence has one), given at its chunk from position 0, where the card starts its
    states from zeros (``state_reset``), kept until ``forget``."""

    what = "Mamba"

    @staticmethod
    def wants(w: SeqWork) -> bool:
        return True
