"""LoRA adapters served beside the base model (vLLM's interface): the server's part of LoRA.

    adapters.py  the flags (--enable-lora, --lora-modules, --max-loras, --max-lora-rank,
                 --max-cpu-loras, --allowed-lora-root), the names a request may give as its
                 model, the scheduler's slot gate, the paths a runtime load may read, and
                 runtime load and unload in the runner's arena
    api.py       /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora)

The model's part (adapters read, slots on the card) is ``models.lora``; the kernel is
``device.kernels.lora``. Imports ``spyre_serve.models``' public names and ``server.openai``'s
shared pieces (api.py). Imported by ``server.engine``, ``server.openai`` and ``server.launch``.
"""
