"""llama.cpp's GGUF files, read without torch.

    file.py        the container: header, metadata, tensor infos, the data's offsets
    checkpoint.py  its tensors as a Hugging Face checkpoint (names and layout mapped); Q8_0,
                   Q4_0 and Q4_1 kept at their width, the other types widened
    hybrid.py      Granite 4.0 hybrids (granitehybrid) and Granite 3.x MoE (granitemoe): llama.cpp's
                   converter undone, tensors in float32
    tokenizer.py   the tokenizer and chat template built from its metadata
    fetch.py       GGUF models a package on the package registry carries, fetched on first use

Imports ``models.config``, ``device.kernels.formats`` (the blocks' layouts) and the ``gguf``
package. Imported by ``models.checkpoints`` and ``models.build``.
"""
