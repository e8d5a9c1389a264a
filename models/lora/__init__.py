"""LoRA adapters on the card (the model's part of LoRA; the server's is ``server.lora``, the
kernel ``device.kernels.lora``).

    adapter.py  a PEFT adapter read from its directory and checked against the model
    target_pattern.py  a string target_modules (a regular expression) matched in linear time
    arena.py    K slots in device memory, placed once, evicted least recently used, pinned
                per running sequence
    layout.py   where a layer's adapters sit in the arena, and the step's call that applies them

Imports ``device`` and ``models.checkpoints.hf`` (safetensors). Imported by ``models.step``
(the runner owns the arena), ``models.build`` and, through ``spyre_serve.models``, the server.
"""
