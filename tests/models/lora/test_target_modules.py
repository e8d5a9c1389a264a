"""adapter.py's target_modules given as a regular expression (PEFT's string form): matched in
time linear in the module path, whatever the pattern (issue 38, finding 2), as Python's re
matches it, and refused naming the field when it uses what PEFT configs do not."""

from __future__ import annotations

import json
import time

import pytest

from spyre_serve.models.lora.adapter import LoraError, read_config


def _config_dir(tmp_path, target_modules):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": target_modules}))
    return tmp_path


def test_a_backtracking_pattern_is_refused_at_once(tmp_path):
    """``.{7}(.|.)*Z`` took 14 s in re's fullmatch, in the engine process, every other request
    waiting; the bound is loose (a noisy 2-core machine), the failure it catches is 14 s."""
    start = time.monotonic()
    with pytest.raises(LoraError, match="target_modules") as e:
        read_config(_config_dir(tmp_path, ".{7}(.|.)*Z"), 16)
    assert time.monotonic() - start < 2, "the pattern backtracked"
    assert "matches none of" in str(e.value)


@pytest.mark.parametrize(("pattern", "targets"), [
    (r".*\.(q_proj|v_proj)", ("q_proj", "v_proj")),
    (r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj", ("q_proj", "k_proj", "v_proj")),
    (r"^(?:.*\.)?(gate_proj|up_proj|down_proj)$", ("gate_proj", "up_proj", "down_proj")),
    (r"(?:.*mlp.*|^model\.embed_tokens$)", ("gate_proj", "up_proj", "down_proj")),   # PEFT's tied form
    (r".*[^_]_proj", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (r"model.layers.[0-9]{1,2}.self_attn.[qo]_proj", ("q_proj", "o_proj")),
    (r".*self_attn\.(?P<name>[a-z])_proj", ("q_proj", "k_proj", "v_proj", "o_proj")),
])
def test_the_patterns_peft_configs_use_pick_their_modules(tmp_path, pattern, targets):
    assert read_config(_config_dir(tmp_path, pattern), 16)[2] == targets


@pytest.mark.parametrize(("pattern", "why"), [
    (r"^(?!.*vision).*\.q_proj$", "lookaround"),
    (r"(?<=self_attn\.)q_proj", "lookaround"),
    (r"(.)\1", "backreference"),
    (r"(?i).*Q_PROJ", "flags"),
    (r".*q_proj" + "|x" * 300, "over 512 characters"),
    (r"(((a{20}){20}){20})", "too large"),
    (r".*(q_proj", "missing )"),
    (r"*q_proj", "nothing to repeat"),
    (r".*[q_proj", "unterminated ["),
    ("", "empty"),
])
def test_what_peft_configs_do_not_use_is_refused_naming_the_field(tmp_path, pattern, why):
    with pytest.raises(LoraError, match="target_modules") as e:
        read_config(_config_dir(tmp_path, pattern), 16)
    assert why in str(e.value)


def test_the_matcher_agrees_with_pythons_re():
    """Random patterns of every feature allowed, against re.fullmatch on short subjects."""
    import random
    import re

    from spyre_serve.models.lora.target_pattern import TargetPattern

    rng = random.Random(0)
    atoms = ["a", "b", ".", r"\.", r"\d", r"\w", r"\W", r"\S", "[ab]", "[^a]", "[a-c.]", r"[\d_]", r"[\.-b]",
             "[]a]", "[^]]", "[-a]", "[a-]", "_", "}", "]", "^", "$"]

    def make(depth: int) -> str:
        parts = []
        for _ in range(rng.randint(1, 3)):
            if depth < 3 and rng.random() < 0.3:
                inner = "|".join(make(depth + 1) for _ in range(rng.randint(1, 3)))
                part = rng.choice(["(", "(?:"]) + inner + ")"
            else:
                part = rng.choice(atoms)
            if part not in ("^", "$") and rng.random() < 0.4:
                part += rng.choice(["*", "+", "?", "{2}", "{0,2}", "{1,}", "{0}", "*?", "??", "{1,2}?"])
            parts.append(part)
        return "".join(parts)

    subjects = ["", "a", "ab", "a.b", "b_a1", "aaa.", "1.a_b", ".._", "ba.ab", "abc.d1_", "]a}", "a-b ", "é9"]
    for _ in range(2000):
        pattern = make(0)
        ours, theirs = TargetPattern(pattern), re.compile(pattern)
        for s in subjects:
            assert ours.fullmatch(s) == bool(theirs.fullmatch(s)), (pattern, s)
