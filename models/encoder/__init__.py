"""Encoders on the card (RoBERTa / XLM-RoBERTa: IBM's granite-embedding models), pooled.

    config.py      EncoderConfig, read from config.json; its sentence-transformers pooling
    weights.py     the checkpoint read and placed on the card once
    program.py     one batched encoder step as a single device program (bidirectional)
    runner.py      EncoderRunner: whole prompts in, one launch, one vector each out
    projection.py  an encoder step's time on a real card

Imports ``device`` (its kernels: ``device.kernels.encoder``, GEMM, pooling) and
``models.step``'s shared pieces (the interface, the buffer layout, buckets).
Imported by ``models.checkpoints.loader`` and ``models.build``.
"""
