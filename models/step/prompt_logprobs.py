"""Prompt logprobs (echo): the logprob of each prompt token and its top-K, chunk by chunk.

Row j of a chunk's log-softmax scores token j + 1, so a chunk scores its own tokens from the
second on, and its last row scores the first token of the next chunk. That row is kept here
between the two steps (`_pending`), which is why results must be read in launch order; a
sequence that ends or is aborted mid-prefill has its row dropped by `forget`.
"""

from __future__ import annotations

import numpy as np

from spyre_serve.models.step.interface import SeqWork


def top_k_of_rows(mat: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32[n, k], logprobs float32[n, k]) of the k largest entries of each row of
    mat [n, V], largest first."""
    if not k:
        return np.zeros((len(mat), 0), np.int32), np.zeros((len(mat), 0), np.float32)
    part = np.argpartition(-mat, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(mat, part, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1).astype(np.int32)
    return ids, np.take_along_axis(mat, ids, axis=1).astype(np.float32)


class PromptLogprobs:
    """The per-sequence state prompt logprobs need across steps, and their computation."""

    def __init__(self):
        self._pending: dict[int, np.ndarray] = {}  # seq_id -> float32[V]: last row of a chunk
                                                   # whose prefill goes on in a later step

    def of_chunk(self, w: SeqWork, lsm: np.ndarray, r0: int):
        """(logprobs float32[n], top ids int32[n, K], top logprobs float32[n, K], ranks
        int32[n]) of the chunk's tokens at position >= 1; lsm [rows, V] is the step's
        log-softmax, the chunk's rows start at r0. K = w.sampling.logprobs; a token's rank is
        1 + the tokens of its row more likely than it (vLLM's: ties share the rank)."""
        n = len(w.token_ids)
        rows, targets = [], []
        prev = self._pending.pop(w.seq_id, None)
        if prev is not None and w.start_pos > 0:
            rows.append(prev)
            targets.append(w.token_ids[0])
        for j in range(n - 1):
            rows.append(lsm[r0 + j])
            targets.append(w.token_ids[j + 1])
        if not w.sample:
            self._pending[w.seq_id] = lsm[r0 + n - 1].copy()
        k = w.sampling.logprobs
        if not rows:
            return (np.zeros(0, np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32),
                    np.zeros(0, np.int32))
        mat = np.stack(rows)                                       # [n', V]
        idx = np.asarray(targets, dtype=np.int64)
        lp = mat[np.arange(len(idx)), idx]
        ranks = (mat > lp[:, None]).sum(axis=1).astype(np.int32) + 1
        return (lp.astype(np.float32), *top_k_of_rows(mat, k), ranks)

    def __len__(self) -> int:
        """Sequences with a row kept."""
        return len(self._pending)

    def forget(self, seq_id: int) -> None:
        """Drop the row kept for a sequence (an unfinished prefill that ended or was aborted)."""
        self._pending.pop(seq_id, None)
