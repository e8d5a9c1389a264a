"""Granite (and Llama, and RoBERTa-family encoders) on the emulated card.

Knows layers, weights and shapes; nothing of HTTP. Imports ``spyre_serve.device`` only; is
imported by ``spyre_serve.server`` (through the names below, never a submodule), ``spyre_torch``
(the eager baseline), the benchmarks and the tests.

    checkpoints/  a model by name, directory or file: HF safetensors, FP8 compressed-tensors,
                  profiles written on first use, tokenizers, --quantization at load
    gguf/         llama.cpp's GGUF files: the container, the tensors as a checkpoint, the
                  tokenizer and chat template, packaged files fetched on first use
    step/         the decoder's step: SeqWork in, one program launch, StepOutput out (the
                  runner, the INPUTS table, buckets, weights and KV cache on the card)
    encoder/      the encoder's step (embeddings): config, weights, program, runner, its clock
    lora/         PEFT adapters: read, placed in the card's slots, applied by the step
    parallel/     one model over several cards: each card's shard and the runner that all-reduces
    sizing/       before and beside a run: will it fit (fit), how long on a real card (projection)
    config.py     GraniteConfig, read from config.json
    build.py      build_runner: the runner a server's settings ask for, of every kind
    eager.py      the eager baseline: the same model run op by op (what the old stack did)

Importing this package loads nothing yet: each name below loads its module when first used
(as ``spyre_serve.device`` does), so the API process, which only needs ``SamplingParams`` and a
few checks, never imports the kernels.
"""

from importlib import import_module

_EXPORTS = {
    # what crosses the runner's boundary (models/step/interface.py)
    "SamplingParams": "step.interface", "SeqWork": "step.interface", "StepOutput": "step.interface",
    "SeqWorkError": "step.interface", "ParamError": "step.interface", "INT32_MAX": "step.interface",
    "MAX_LOGPROBS": "step.interface",
    # the runners
    "ModelRunner": "step.runner", "StepHandle": "step.runner",
    "build_runner": "build", "Built": "build", "RunnerSettings": "build",
    # models by name and from disk
    "GraniteConfig": "config", "ConfigError": "config",
    "LoadedModel": "checkpoints.loader", "load_model": "checkpoints.loader",
    "tokenizer_of": "checkpoints.loader",
    "resolve_model": "checkpoints.profiles", "model_names": "checkpoints.profiles",
    "IncrementalDetokenizer": "checkpoints.tokenizer",
    "model_config": "build", "names_gguf": "build", "file_gemm_formats": "build",
    "any_quantized": "gguf.placement", "GRANITE_33_8B": "build",
    # LoRA adapters (runtime load and unload)
    "LoraError": "lora.adapter", "read_adapter": "lora.adapter",
    # will it fit, and how long on a real card (spyre-serve plan)
    "CARD_BYTES": "sizing.fit", "CARD_USABLE_BYTES": "sizing.fit",
    "PLUGIN_GRANITE_33_8B": "sizing.fit", "CardFit": "sizing.fit", "largest_batch": "sizing.fit",
    "largest_context": "sizing.fit", "plan_fit": "sizing.fit",
    "project_request": "sizing.projection",
    "resolve_kv_dtype": ("step.kv_cache", "resolve_dtype"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spyre_serve.models' has no attribute {name!r}")
    where = _EXPORTS[name]
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value
