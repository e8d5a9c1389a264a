"""Attention over the paged KV cache, as flash attention computes it.

    paged.py           write_kv (this step's K and V into their blocks) and attention over a
                       ragged batch (each row its own sequence's blocks; causal, GQA)
    online_softmax.py  the online-softmax update: one block of scores folded into a running
                       max, sum and output

Imports ``device.kernels.gemm`` (a KV block is a GEMM tile's weight as it stands),
``device.kernels.simd`` and ``device.kernels.fastexp``. Imported by ``models.step.program``
and ``spyre_torch``'s attention. The encoder's bidirectional attention lives with the encoder's
kernels (``device.kernels.encoder``).
"""
