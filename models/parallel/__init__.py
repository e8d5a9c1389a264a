"""Tensor parallelism: one model over several emulated cards, as the vLLM Spyre plugin runs it.

    shards.py  one card's share of a checkpoint, split as vLLM's linear layers split it
    runner.py  TensorParallelRunner: the step in parts on every card, all-reduced between them

Imports ``models.step`` and ``models.sizing.fit`` (each card's config). Imported by
``models.build``.
"""
