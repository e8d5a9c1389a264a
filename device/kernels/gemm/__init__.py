"""GEMM on weights placed once in panels (weight-stationary), one tile kind per ISA feature.

    packed.py       gemm_packed: the GEMM the step calls, over every weight format
    inputs.py       a GEMM's activations prepared once as its tiles read them (bf16, int8)
    microkernel.py  the innermost mr x NR tile, emitted as LLVM vector IR (fp32/16-bit/8-/4-bit)
    int8_tile.py    8- and 4-bit weights on int8 activations (vpmaddubsw, or vpdpbusd with VNNI)
    dot_tile.py     bf16 x bf16 with AVX512_BF16's dot product (vdpbf16ps)
    amx.py          bf16 x bf16 with AMX tiles
    dequant.py      8- and 4-bit panels widened to bfloat16 for the AMX tiles (a prompt's rows)

Imports the kernels' shared pieces (``device.kernels.simd``: the vector geometry;
``device.kernels.formats``: the weights' number formats). Imported by the step programs
(``models.step.program``, ``models.encoder.program``), ``device.kernels.lora``, the attention
kernels (which run these tiles on KV blocks) and ``spyre_torch``'s matmul.
"""
