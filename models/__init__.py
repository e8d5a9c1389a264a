"""Granite on the emulated card: config, checkpoints, tokenizer, weights, KV cache, the step
program and the runner that launches it. Knows layers, weights and shapes; nothing of HTTP."""

from spyre_serve.models.config import ConfigError, GraniteConfig
from spyre_serve.models.loader import LoadedModel, load_model
from spyre_serve.models.profiles import resolve_model
from spyre_serve.models.runner import ModelRunner, StepHandle
from spyre_serve.models.step_io import SamplingParams, SeqWork, StepOutput

__all__ = [
    "ConfigError", "GraniteConfig", "LoadedModel", "ModelRunner", "SamplingParams", "SeqWork",
    "StepHandle", "StepOutput", "load_model", "resolve_model",
]
