"""Granite on the emulated card: config, checkpoints, tokenizer, weights, KV cache, the step
program and the runner that launches it. Knows layers, weights and shapes; nothing of HTTP."""

from pathlib import Path

import device
from device.cache import use_source_keyed_cache

# The step program compiles device kernels into itself: its cache is keyed on both packages'
# sources (device/cache.py), set before the modules below decorate their functions.
use_source_keyed_cache(Path(device.__file__).parent, Path(__file__).parent)

from models.config import ConfigError, GraniteConfig  # noqa: E402
from models.loader import LoadedModel, load_model  # noqa: E402
from models.profiles import resolve_model  # noqa: E402
from models.runner import ModelRunner, StepHandle  # noqa: E402
from models.step_io import SamplingParams, SeqWork, StepOutput  # noqa: E402

__all__ = [
    "ConfigError", "GraniteConfig", "LoadedModel", "ModelRunner", "SamplingParams", "SeqWork",
    "StepHandle", "StepOutput", "load_model", "resolve_model",
]
