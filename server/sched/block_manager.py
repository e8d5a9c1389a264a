"""KV cache accounting: which of the ``num_blocks`` blocks each sequence holds, and which
full blocks hold which tokens (prefix caching).

The blocks themselves live on the device (models/ owns them); here they are
only numbers. A sequence's block table grows as its computed tokens grow and
is handed back whole when it finishes, aborts or is preempted.

Prefix caching (vLLM v1's, ``enable_caching``): a full block is content-addressed by a hash
of its tokens and of the previous block's hash (``hash_block``), so a hash names the whole
prefix up to the block's end. ``cache_full_blocks`` registers a sequence's full blocks under
their hashes (the scheduler calls it when a chunk that fills them is launched: steps run in
order on one stream, so a later step reads what an earlier one wrote); ``lookup`` finds the
longest run of a new sequence's leading blocks that some block holds, and ``share`` gives
them to it. Blocks are reference-counted: a block held by several sequences is freed when
the last lets go. A freed block that holds a registered hash stays cached, and a later
``lookup`` can take it back, until it is evicted to hold something else, least recently
freed first. ``uncache`` forgets a block's hash (its content is not what it says).

Which free block is handed out (``_allocate``): first one that holds no cached content and
was used before, most recently freed first (last in, first out); then the least recently
used cached block (evicted: its hash is forgotten); only then a block never used. The blocks
in use stay the ones most recently written, and the cache's working set is what the load
needs at its peak rather than, over hours, every block (on the emulated card, each block
first written is host memory the process keeps: a FIFO made the RSS of a 30-minute soak
creep towards the whole KV cache). The prefix cache therefore lives in the blocks the load
has touched: it evicts before it grows into blocks never used.

``num_free`` counts every block no sequence holds, cached or not: what ``grow`` can hand out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from spyre_serve.server.sched.sequence import Sequence


def lora_key(params) -> tuple[str, int] | None:
    """A sequence's adapter as the prefix cache keys it: (name, load id), None for the base."""
    return None if params.lora is None else (params.lora, params.lora_id)


def salt_root(salt: str | None, lora: tuple[str, int] | None = None) -> bytes | None:
    """What a salted sequence's first block hashes in place of a parent: a digest of its salt
    (vLLM's cache_salt) and its LoRA adapter (name, load id), so two salts or adapters never
    name the same block; None for neither."""
    if lora is None:
        return None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()
    text = f"{salt is not None}\0{salt or ''}\0{lora[0]}\0{lora[1]}"
    return hashlib.sha256(b"lora\0" + text.encode()).digest()


def hash_block(parent: bytes | None, tokens) -> bytes:
    """The content address of a full block: SHA-256 of the previous block's hash (none for
    the first block) and the block's token ids (a hash that cannot be steered into a
    collision, as vLLM's sha256 option)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """What ``lookup`` found, in tokens (vLLM's ``vllm:prefix_cache_queries/hits``)."""

    queries: int = 0  # tokens of the sequences looked up
    hits: int = 0  # of those, tokens found in the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # free blocks holding no cached content: freed ones at the left (LIFO), then the
        # blocks never handed out, in order (those >= _next_fresh)
        self._free: deque[int] = deque(range(num_blocks))
        self._next_fresh = 0
        self._ref = [0] * num_blocks  # sequences holding each block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached, LRU first
        self._hash_of: dict[int, bytes] = {}  # block -> the hash it is registered under
        self._by_hash: dict[bytes, int] = {}  # hash -> block
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered hash (in use or free)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_tokens`` tokens."""
        need = self.extra_blocks(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(
                f"seq {seq.seq_id} needs {need} more KV blocks for {num_tokens} tokens, "
                f"{self.num_free} of {self.num_blocks} free"
            )
        for _ in range(need):
            block = self._allocate()
            self._ref[block] = 1
            seq.block_table.append(block)

    def _allocate(self) -> int:
        if self._free and self._free[0] < self._next_fresh:
            return self._free.popleft()  # used before, holds nothing cached: LIFO
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            del self._by_hash[self._hash_of.pop(block)]
            return block
        block = self._free.popleft()  # never used: the next in order
        self._next_fresh = block + 1
        return block

    def free(self, seq: Sequence) -> None:
        """Let go of all of ``seq``'s blocks (idempotent); a block no sequence holds any
        more is free: cached (most recently used) when it holds a registered hash. Its last
        blocks are the least recently used of it (a prefix is shared more than its tail)."""
        cached = []
        for block in seq.block_table:
            if self._ref[block] <= 0:
                raise RuntimeError(f"block {block} freed by seq {seq.seq_id} but held by no sequence")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    cached.append(block)
                else:
                    self._free.appendleft(block)
        for block in reversed(cached):
            self._evictable[block] = None
        seq.block_table = []
        seq.num_cached_blocks = 0

    # ---- prefix caching ---------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of ``seq``'s first ``num_blocks`` full blocks of known tokens (fewer
        when fewer are full), computed once per sequence."""
        hashes, bs, ids = seq.block_hashes, self.block_size, seq.token_ids
        while len(hashes) < num_blocks and (len(hashes) + 1) * bs <= len(ids):
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_root(seq.params.cache_salt, lora_key(seq.params))
            hashes.append(hash_block(parent, ids[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def lookup(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The blocks holding the longest cached prefix of ``seq``'s tokens, at most
        ``max_tokens`` of them (whole blocks only). Changes nothing."""
        if not self.enable_caching or max_tokens < self.block_size:
            return []
        blocks = []
        for h in self.block_hashes(seq, max_tokens // self.block_size):
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_share(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        """Whether ``seq`` (holding no block) can take ``hit`` and grow to ``num_tokens``."""
        revived = sum(1 for b in hit if self._ref[b] == 0)  # free now, held once shared
        return self.blocks_for(num_tokens) - len(hit) + revived <= self.num_free

    def share(self, seq: Sequence, hit: list[int], num_queried: int) -> None:
        """``seq`` (holding no block) starts from the cached blocks ``hit``; counts the
        lookup of ``num_queried`` tokens in ``stats``."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} shares cached blocks but holds {seq.block_table}")
        for block in hit:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        seq.block_table = list(hit)
        seq.num_cached_blocks = len(hit)
        self.stats.queries += num_queried
        self.stats.hits += len(hit) * self.block_size

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> list[tuple[int, bytes]]:
        """Register the blocks of ``seq`` that its first ``num_tokens`` tokens fill (tokens
        known on the host only) under their hashes; a hash some block already holds stays
        with that block. Returns the (block, hash) pairs registered now."""
        if not self.enable_caching:
            return []
        full = min(num_tokens, len(seq.token_ids)) // self.block_size
        full = min(full, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return []
        hashes = self.block_hashes(seq, full)
        added = []
        for i in range(seq.num_cached_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
                added.append((block, h))
        seq.num_cached_blocks = full
        return added

    def uncache(self, block: int, h: bytes) -> bool:
        """Forget that ``block`` holds ``h`` (what it holds is not that): no lookup finds it
        any more; free, it is an ordinary free block. False when it was not registered so."""
        if self._hash_of.get(block) != h:
            return False
        del self._hash_of[block]
        del self._by_hash[h]
        if block in self._evictable:
            del self._evictable[block]
            self._free.appendleft(block)
        return True
