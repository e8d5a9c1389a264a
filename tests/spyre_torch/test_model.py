"""transformers' Granite and Llama with `model.to("spyre")`: the CPU's logits and greedy tokens,
with no op falling back to the CPU (the fallback counter stays empty)."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint

PROMPT = [[1, 5, 9, 22, 7, 3, 100, 41]]


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory):
    # untied: a tied random Granite repeats one token (docs/design.md, "Testing with random weights")
    return write_granite_checkpoint(tmp_path_factory.mktemp("granite"), vocab=256, hidden=64,
                                    layers=2, heads=4, kv_heads=2, tie=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("llama"), vocab=256, hidden=128,
                                    layers=2, heads=4, kv_heads=2, tie=True, llama=True)


def _greedy(model, device: str, n: int) -> list[int]:
    ids = torch.tensor(PROMPT).to(device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
    return out[0, len(PROMPT[0]):].cpu().tolist()


@pytest.mark.parametrize("which", ["granite_dir", "llama_dir"])
def test_forward_gives_the_cpus_logits_with_no_fallback(which, request, fallbacks):
    path = request.getfixturevalue(which)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = load_reference_model(path)(ids).logits
        got = load_reference_model(path).to("spyre")(ids.to("spyre")).logits
    assert got.device.type == "spyre"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=2e-5)
    assert fallbacks() == {}


@pytest.mark.parametrize("which", ["granite_dir", "llama_dir"])
def test_greedy_generate_gives_the_cpus_tokens_with_no_fallback(which, request, fallbacks):
    path = request.getfixturevalue(which)
    expected = _greedy(load_reference_model(path), "cpu", 16)
    assert len(set(expected)) >= 8, f"the reference output is not varied: {expected}"
    assert _greedy(load_reference_model(path).to("spyre"), "spyre", 16) == expected
    assert fallbacks() == {}


def test_the_models_weights_live_on_the_card(granite_dir):
    start = torch.spyre.memory_allocated()
    model = load_reference_model(granite_dir).to("spyre")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.device.type == "spyre" for p in model.parameters())
    assert torch.spyre.memory_allocated() - start >= params
    del model
    torch.spyre.empty_cache()
    assert torch.spyre.memory_allocated() == start


def test_granite_tiny_prefill_and_decode_through_eager_model_match_the_cpu(fallbacks):
    from spyre_serve.models import resolve_model
    from spyre_torch.eager import EagerModel

    path = resolve_model("granite-tiny")
    prompt = list(range(40, 72))
    tokens = {}
    for device in ("cpu", "spyre"):
        m = EagerModel.load(path, device)
        assert m.model.lm_head.weight is m.model.model.embed_tokens.weight  # still tied on spyre
        first = m.prefill(prompt)
        prefill = m.stats
        tokens[device] = [first, *m.decode(first, 6)]
    assert tokens["spyre"] == tokens["cpu"] and len(set(tokens["cpu"])) >= 4
    assert prefill.tokens == 32 and prefill.launches > 100 and prefill.compute_seconds > 0
    assert m.stats.tokens == 6 and m.stats.launches > 6 * 100 and m.stats.fallbacks == {}
    assert fallbacks() == {}
