"""A model by name, directory or file, read without torch.

    loader.py              load_model: a name, checkpoint directory or GGUF file -> a
                           LoadedModel whose weights are on the card
    hf.py                  Hugging Face checkpoints: safetensors (fp32/bf16/fp16), their shapes checked
    compressed_tensors.py  FP8 checkpoints in llm-compressor's compressed-tensors format
    quantize.py            --quantization: a float checkpoint's matrices quantized at load
    profiles.py            embedded models by name, written on first use; packaged GGUF files
    tokenizer.py           tokenizers (tokenizers' JSON) and incremental detokenization

Imports ``models.config``, ``models.gguf`` (a GGUF file is read as a checkpoint),
``models.step.weights`` and ``models.encoder`` (to place what it read) and ``device``.
Imported through ``spyre_serve.models`` by the server; by the other packages here.
"""
