"""KV cache accounting: which of the ``num_blocks`` blocks each sequence owns.

The blocks themselves live on the device (models/ owns them); here they are
only numbers. A sequence's block table grows as its computed tokens grow and
is handed back whole when it finishes, aborts or is preempted.

Freed blocks are handed out again first (last in, first out): the blocks in use
stay the ones most recently written, and the cache's working set is what the load
needs at its peak rather than, over hours, every block (on the emulated card, each
block first written is host memory the process keeps: a FIFO made the RSS of a
30-minute soak creep towards the whole KV cache).
"""

from __future__ import annotations

from collections import deque

from server.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, int] = {}  # block id -> seq id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_tokens`` tokens."""
        need = self.extra_blocks(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(
                f"seq {seq.seq_id} needs {need} more KV blocks for {num_tokens} tokens, "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        for _ in range(need):
            block = self._free.popleft()
            self._owner[block] = seq.seq_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks (idempotent)."""
        for block in seq.block_table:
            owner = self._owner.pop(block, None)
            if owner != seq.seq_id:
                raise RuntimeError(f"block {block} freed by seq {seq.seq_id} but owned by {owner}")
            self._free.appendleft(block)
        seq.block_table = []
