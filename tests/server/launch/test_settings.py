"""settings.py: one table from which the flags, their environment variables and help come."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from spyre_serve.server.launch.settings import SIZING, Settings, add_flags, parse_size


def parser_for(*names: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, names)
    return p


def test_every_field_has_help_and_a_parser():
    for f in fields(Settings):
        assert f.metadata["help"] and callable(f.metadata["parse"]), f.name


def test_warmup_takes_the_flags_that_size_the_programs_and_memory():
    assert SIZING == ("model", "max_num_seqs", "max_num_batched_tokens", "dtype", "numerics", "compute_dtype",
                      "quantization",
                      "kv_cache_dtype", "runner", "pooler_config", "block_size", "tensor_parallel_size",
                      "num_kv_blocks", "max_model_len",
                      "device_memory", "enable_lora", "max_loras", "max_lora_rank",
                      "log_level")


def test_a_flag_is_parsed_by_its_fields_parser():
    args = parser_for("device_memory", "drain_timeout").parse_args(["--device-memory", "1.5G", "--drain-timeout", "2"])
    assert (args.device_memory, args.drain_timeout) == (3 << 29, 2.0)


def test_an_environment_value_is_parsed_like_the_flag(monkeypatch):
    monkeypatch.setenv("SPYRE_SERVE_MAX_BODY_BYTES", "2M")
    monkeypatch.setenv("SPYRE_SERVE_PORT", "9000")
    assert vars(parser_for("max_body_bytes", "port").parse_args([])) == {"max_body_bytes": 2 << 20, "port": 9000}


def test_a_bad_environment_value_is_refused_naming_the_flag(monkeypatch, capsys):
    monkeypatch.setenv("SPYRE_SERVE_DEVICE_MEMORY", "lots")
    with pytest.raises(SystemExit):
        parser_for("device_memory").parse_args([])
    assert "--device-memory: not a size: 'lots'" in capsys.readouterr().err


def test_a_boolean_flag_reads_the_environment_and_has_a_no_form(monkeypatch):
    monkeypatch.setenv("SPYRE_SERVE_WARMUP", "off")
    assert parser_for("warmup").parse_args([]).warmup is False
    assert parser_for("warmup").parse_args(["--warmup"]).warmup is True
    monkeypatch.delenv("SPYRE_SERVE_WARMUP")
    assert parser_for("warmup").parse_args(["--no-warmup"]).warmup is False


def test_help_names_each_flags_environment_variable():
    text = " ".join(parser_for("max_num_seqs").format_help().split())  # unwrapped
    assert "--max-num-seqs MAX_NUM_SEQS" in text
    assert "most sequences in one step (running requests) [env SPYRE_SERVE_MAX_NUM_SEQS]" in text


def test_parse_size_refuses_in_argparses_way():
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: 'lots'"):
        parse_size("lots")


def test_the_served_name_is_the_flag_or_the_models():
    class Model:
        name = "granite-tiny"

    assert Settings().served_name(Model()) == "granite-tiny"
    assert Settings(served_model_name="g").served_name(Model()) == "g"


def test_a_chat_template_is_a_file_or_a_template_and_a_missing_file_is_refused(tmp_path, capsys):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    assert parser_for("chat_template").parse_args(["--chat-template", str(template)]).chat_template == str(template)
    assert parser_for("chat_template").parse_args(["--chat-template", "{{ messages }}"]).chat_template \
        == "{{ messages }}"
    with pytest.raises(SystemExit):
        parser_for("chat_template").parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
    err = capsys.readouterr().err
    assert "--chat-template" in err and "looks like a file path, but it could not be read" in err


def test_generation_config_is_auto_unless_told(tmp_path, capsys):
    assert Settings().generation_config == "auto"
    assert parser_for("generation_config").parse_args(["--generation-config", "vllm"]).generation_config == "vllm"
    with pytest.raises(SystemExit):
        parser_for("generation_config").parse_args(["--generation-config", str(tmp_path)])
    assert "is not auto, vllm or a directory holding a generation_config.json" in capsys.readouterr().err
    (tmp_path / "generation_config.json").write_text("{}")
    assert parser_for("generation_config").parse_args(["--generation-config", str(tmp_path)]).generation_config \
        == str(tmp_path)


def test_the_pooling_types_settings_know_are_the_kernels():
    from spyre_serve.device.kernels.pooling import POOLING_TYPES as KERNEL
    from spyre_serve.server.launch.settings import POOLING_TYPES

    assert set(POOLING_TYPES) == set(KERNEL)


def test_the_quantizations_the_flag_takes_are_the_ones_the_loader_applies():
    from spyre_serve.models.checkpoints.quantize import QUANTIZATIONS as LOADER
    from spyre_serve.server.launch.cli import parse_command
    from spyre_serve.server.launch.settings import QUANTIZATIONS

    assert set(QUANTIZATIONS) - {"none"} == set(LOADER)
    assert parse_command(["serve", "--quantization", "fp8"])[1].quantization == "fp8"
