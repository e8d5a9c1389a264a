"""`spyre-serve plan`: from a config alone, what each card holds and what is left, the refusals
with their numbers, and serving's refusal of more than one card."""

from __future__ import annotations

import io
import json

import pytest

from spyre_serve.models import model_config as plan_config
from spyre_serve.models.sizing.fit import (
    kv_token_bytes,
    largest_batch,
    largest_context,
    lora_arena_bytes,
    plan_fit,
    weight_bytes,
)
from spyre_serve.server.launch.cli import parse_command
from spyre_serve.server.launch.plan import plan
from spyre_serve.server.launch.settings import Settings

BUDGET = Settings().max_num_batched_tokens     # the plan's chunk: the default budget


def run(*argv: str) -> tuple[int, str]:
    command, s = parse_command(["plan", *argv])
    assert command == "plan"
    out = io.StringIO()
    return plan(s, out), out.getvalue()


def test_granite_33_8b_at_tp_1_and_4():
    code, text = run("--model", "granite-3.3-8b", "--max-model-len", "3072", "--max-num-seqs", "16",
                     "--dtype", "float16")
    assert code == 0, text
    cfg = plan_config("granite-3.3-8b")
    assert f"  weights                {weight_bytes(cfg, 'float16') / 1e9:9.2f} GB" in text
    assert "16 sequences x 3,072 tokens (160.0 KiB a token" in text
    assert "the vLLM Spyre plugin serves Granite 3.3 8B at tensor parallel 1 with 3,072 tokens x 16" in text
    from spyre_serve.models.sizing.projection import project_request

    ttft, tpot = project_request(cfg, 3071, 2, 16, tp=1, chunk=BUDGET, formats="float16", kv_bytes=2)
    assert (f"TTFT {ttft * 1e3:,.1f} ms for a prompt filling the context (3,071 tokens in chunks of {BUDGET}), "
            f"TPOT {tpot * 1e3:,.2f} ms with 16 sequences decoding at 3,072 tokens") in text
    code, text = run("--model", "granite-3.3-8b", "--tensor-parallel-size", "4", "--max-model-len", "32768",
                     "--max-num-seqs", "32", "--dtype", "float16")
    assert code == 0 and "each of the 4 card(s) holds" in text and "(40.0 KiB a token" in text
    fit = plan_fit(cfg, dtype="float16", kv_dtype="float16", tp=4, max_num_seqs=32, max_num_batched_tokens=BUDGET,
                   max_model_len=32768, block_size=64)
    assert f"{fit.left / 1e9:.2f} GB left" in text
    sizes = dict(dtype="float16", kv_dtype="float16", tp=4, max_num_batched_tokens=BUDGET)
    context = largest_context(cfg, max_num_seqs=32, block_size=64, **sizes)
    batch = largest_batch(cfg, max_model_len=32768, block_size=64, **sizes)
    assert f"largest context at 32 sequences: {context:,} tokens" in text
    assert f"largest batch at 32,768 tokens: {batch:,} sequences" in text
    # what the plan says is the largest fits when given back, and one block more does not
    for argv, ok in ((["--max-model-len", str(context), "--max-num-seqs", "32"], 0),
                     (["--max-model-len", str(context + 64), "--max-num-seqs", "32"], 1),
                     (["--max-model-len", "32768", "--max-num-seqs", str(batch)], 0),
                     (["--max-model-len", "32768", "--max-num-seqs", str(batch + 1)], 1)):
        code, _ = run("--model", "granite-3.3-8b", "--tensor-parallel-size", "4", "--dtype", "float16", *argv)
        assert code == ok, argv


def test_lora_slots_are_planned_and_priced():
    """--enable-lora: the arena of --max-loras slots at --max-lora-rank is on the card, counted
    in the largest context and batch, and the projection spreads the batch over the adapters."""
    base = ["--model", "granite-3.3-8b", "--max-model-len", "3072", "--max-num-seqs", "16", "--dtype", "float16"]
    _, without = run(*base)
    code, text = run(*base, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64")
    assert code == 0, text
    cfg = plan_config("granite-3.3-8b")
    arena = lora_arena_bytes(cfg, 4, 64)
    # per layer: the scales (7 x 4 floats, one stick) and, per slot, 64 x (the seven modules'
    # inputs + outputs: q, k, v, o, gate, up, down) float32 values
    assert arena == 40 * 4 * (32 + 4 * 64 * (2 * 4096 + 2 * (4096 + 1024) + 2 * 4096 + 2 * (4096 + 12800)
                                             + 12800 + 4096))
    assert f"  LoRA adapters          {arena / 1e9:9.2f} GB   4 slot(s) of rank 64" in text
    fit = plan_fit(cfg, dtype="float16", kv_dtype="float16", tp=1, max_num_seqs=16, max_num_batched_tokens=BUDGET,
                   max_model_len=3072, block_size=64, lora=(4, 64))
    assert fit.total == plan_fit(cfg, dtype="float16", kv_dtype="float16", tp=1, max_num_seqs=16,
                                 max_num_batched_tokens=BUDGET, max_model_len=3072, block_size=64).total + arena
    assert f"{fit.left / 1e9:.2f} GB left" in text
    context = largest_context(cfg, max_num_seqs=16, block_size=64, dtype="float16", kv_dtype="float16", tp=1,
                              max_num_batched_tokens=BUDGET, lora=(4, 64))
    assert f"largest context at 16 sequences: {context:,} tokens" in text and context < int(
        without.split("largest context at 16 sequences: ")[1].split(" ")[0].replace(",", ""))
    from spyre_serve.models.sizing.projection import project_request

    ttft, tpot = project_request(cfg, 3071, 2, 16, chunk=BUDGET, formats="float16", kv_bytes=2, lora=(4, 64))
    assert f"TTFT {ttft * 1e3:,.1f} ms" in text and f"TPOT {tpot * 1e3:,.2f} ms" in text
    assert "spread over 4 LoRA adapter(s) of rank 64" in text
    assert ttft > project_request(cfg, 3071, 2, 16, chunk=BUDGET, formats="float16", kv_bytes=2)[0]


def test_a_plan_that_does_not_fit_exits_1_with_the_numbers():
    code, text = run("--model", "granite-3.3-8b", "--max-model-len", "131072", "--max-num-seqs", "32",
                     "--dtype", "float32")
    assert code == 1
    assert "does not fit: each card needs" in text and "and has 112.00 GB" in text
    code, text = run("--model", "granite-3.3-8b", "--tensor-parallel-size", "3")
    assert code == 1 and "num_attention_heads (32) is not divisible by --tensor-parallel-size 3" in text
    code, text = run("--model", "granite-3.3-8b", "--max-model-len", "200000")
    assert code == 1 and "over the model's 131,072 positions" in text
    for argv, why in ((["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
                      (["--quantization", "int8"], "not sized yet"),
                      (["--max-num-batched-tokens", "100"], None)):
        code, text = run("--model", "granite-3.3-8b", "--max-model-len", "4096", *argv)
        assert (code, why is None or why in text) == (1 if why else 0, True), text
    assert "in chunks of 64)" in text            # 100 tokens a step: the card's chunks of 64


def test_a_config_the_server_cannot_run_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["RobertaModel"], "hidden_size": 8}))
    code, text = run("--model", str(tmp_path))
    assert code == 1 and text.startswith("cannot plan") and len(text.splitlines()) == 1


def test_a_checkpoint_directory_or_its_config_alone(tmp_path):
    from tests.models.hf_checkpoints import granite_config

    (tmp_path / "config.json").write_text(json.dumps(granite_config(hidden=256, layers=3).to_dict()))
    code, text = run("--model", str(tmp_path), "--max-model-len", "1024", "--max-num-seqs", "4")
    assert code == 0, text
    cfg = plan_config(str(tmp_path / "config.json"))
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == cfg.hidden_size
    assert f"({kv_token_bytes(cfg, 'float32') / 1024:.1f} KiB a token" in text
    assert "emulator on this machine" in text


def test_warmup_takes_one_card_and_serve_several():
    assert parse_command(["serve", "--tensor-parallel-size", "2"])[1].tensor_parallel_size == 2
    with pytest.raises(SystemExit):
        parse_command(["warmup", "--tensor-parallel-size", "2"])


def test_the_command_line_loads_no_kernel_before_configuring_the_process():
    """A kernel module imported before device.process.configure() keeps a compile cache not keyed
    by the sources (the process warns): plan, as serve, imports none first."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "spyre_serve.server.launch.cli", "plan", "--model", "granite-tiny",
                          "--max-model-len", "1024"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kernels imported before" not in out.stderr and "each of the 1 card(s) holds" in out.stdout
