"""Speculative decoding (--speculative-config, vLLM's JSON): tokens proposed, verified in one step.

    proposals.py    the config, and the ngram (prompt lookup) proposer: which tokens to propose
    draft_model.py  a draft model's proposals: k greedy tokens in k launches on the same card

Imports ``server.sched.sequence``. Imported by ``server.sched.scheduler`` (it schedules the
proposals) and ``server.launch``. The draft model's runner is built by ``models.build_runner``.
"""
