"""Granite on the emulated card: config, checkpoints, tokenizer, weights, KV cache, the step
program and the runner that launches it. Knows layers, weights and shapes; nothing of HTTP."""

from spyre_serve.models.checkpoints.loader import LoadedModel, load_model
from spyre_serve.models.checkpoints.profiles import resolve_model
from spyre_serve.models.config import ConfigError, GraniteConfig
from spyre_serve.models.step.interface import SamplingParams, SeqWork, StepOutput
from spyre_serve.models.step.runner import ModelRunner, StepHandle

__all__ = [
    "ConfigError", "GraniteConfig", "LoadedModel", "ModelRunner", "SamplingParams", "SeqWork",
    "StepHandle", "StepOutput", "load_model", "resolve_model",
]
