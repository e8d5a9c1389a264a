"""PEFT LoRA adapters written by the tests, and transformers + peft as their reference.

    path = write_lora_adapter(base_dir, out_dir, r=8, alpha=16, targets=["q_proj", "v_proj"])
    ref = reference_with_adapter(base_dir, path)     # PeftModel over the fp32 base, eval mode

peft initializes lora_B to zero (an adapter that changes nothing); these draw A and B from a
seeded normal distribution of std `std`, so each adapter moves the output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.models.hf_checkpoints import load_reference_model


def write_lora_adapter(base_dir, out_dir, *, r: int, alpha: float, targets, seed: int = 0,
                       std: float = 0.2, use_rslora: bool = False) -> Path:
    """Save a random LoRA adapter of the base checkpoint at ``base_dir`` into ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = load_reference_model(base_dir)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     bias="none", use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.from_numpy(rng.normal(0.0, std, tuple(p.shape)).astype(np.float32)))
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    return out


def reference_with_adapter(base_dir, adapter_dir):
    """transformers' model of the base checkpoint with the adapter applied by peft (fp32)."""
    from peft import PeftModel

    # on the CPU: peft would otherwise load onto torch.accelerator, which is spyre_torch's card
    # once a test has imported it (peft >= 0.22)
    return PeftModel.from_pretrained(load_reference_model(base_dir), str(adapter_dir),
                                     torch_device="cpu").eval()


def reference_greedy(ref, prompt, n_new) -> tuple[list[int], float]:
    """The reference's greedy continuation (argmax of each forward pass) and the smallest
    relative top-1/top-2 gap along it."""
    import torch

    ids, gap = list(prompt), np.inf
    with torch.no_grad():
        for _ in range(n_new):
            logits = ref(input_ids=torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            gap = min(gap, ((top2[0] - top2[1]) / logits.abs().max()).item())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], gap


def runner_greedy_lora(runner, prompts, adapters, n_new, block_size=16, first_seq=0):
    """Every prompt prefilled in one launch with its adapter (None: the base), then one decode
    launch for all at a time; returns the generated ids of each, the sequences forgotten."""
    from spyre_serve.models import SamplingParams, SeqWork

    greedy = SamplingParams(temperature=0.0)
    per_seq = -(-(max(len(p) for p in prompts) + n_new) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    ids = [first_seq + i for i in range(len(prompts))]
    work = [SeqWork(ids[i], list(p), 0, tables[i], True, greedy, lora=adapters[i])
            for i, p in enumerate(prompts)]
    generated = [[int(t)] for t in runner.launch(work).result().token_ids]
    for step in range(1, n_new):
        work = [SeqWork(ids[i], [generated[i][-1]], len(prompts[i]) + step - 1, tables[i], True,
                        greedy, num_generated=step, lora=adapters[i]) for i in range(len(prompts))]
        for i, t in enumerate(runner.launch(work).result().token_ids):
            generated[i].append(int(t))
    for i in ids:
        runner.forget(i)
    return generated


def write_numpy_adapter(out_dir, config, *, r: int = 4, alpha: float = 8.0, targets=("q_proj", "v_proj"),
                        seed: int = 0, std: float = 0.2) -> Path:
    """A PEFT-format adapter of the GraniteConfig ``config`` written with numpy and safetensors
    (no torch, no peft): for tests of the files and the registry, not of the numbers."""
    import json

    from safetensors.numpy import save_file

    from spyre_serve.models.lora.layout import MODULES, module_dims

    parents = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    c, rng, out = config, np.random.default_rng(seed), Path(out_dir)
    dims = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
            c.intermediate_size)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for module in targets:
            k, n = module_dims(MODULES.index(module), *dims)
            key = f"base_model.model.model.layers.{layer}.{parents.get(module, 'self_attn')}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, std, (r, k)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, std, (n, r)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out
