"""Granite on the emulated card: config, checkpoints, tokenizer, weights, KV cache, the step
program and the runner that launches it. Knows layers, weights and shapes; nothing of HTTP."""

from models.config import ConfigError, GraniteConfig
from models.loader import LoadedModel, load_model
from models.profiles import resolve_model
from models.runner import ModelRunner, StepHandle
from models.step_io import SamplingParams, SeqWork, StepOutput

__all__ = [
    "ConfigError", "GraniteConfig", "LoadedModel", "ModelRunner", "SamplingParams", "SeqWork",
    "StepHandle", "StepOutput", "load_model", "resolve_model",
]
