"""What ``spyre-serve`` is configured with: one table, ``Settings``, one field per flag.

Each field holds its default, its help text, how a flag's text is parsed, and whether
``warmup`` takes it (the flags that decide the programs and the memory plan). The
command-line flags, their ``SPYRE_SERVE_<FLAG>`` environment variables and ``--help``
are all derived from it (``add_flags``); the app reads the fields it needs from it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from spyre_serve.device.memory import DeviceError, parse_bytes
from spyre_serve.server.lora.adapters import check_lora_settings, parse_lora_module, parse_lora_root
from spyre_serve.server.sched.spyre_compat import check_settings
from spyre_serve.server.spec_decode.proposals import SpeculativeConfig

ENV_PREFIX = "SPYRE_SERVE_"


def parse_bool(text: str) -> bool:
    return text.strip().lower() in {"1", "true", "yes", "on"}


def parse_size(text: str) -> int:
    """A byte size as the device reads it (``device.memory.parse_bytes``), refused the way
    argparse refuses a bad flag value (the message names the flag and the value)."""
    try:
        return parse_bytes(text)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_dtype(text: str) -> str:
    """A weight or compute width: auto, float32, bfloat16, float16 (vLLM's --dtype names) or
    dlfloat16 (the card's own 16-bit format)."""
    value = text.strip().lower()
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPES)}")
    return value


DTYPES = ("auto", "float32", "bfloat16", "float16", "dlfloat16")
COMPUTE_DTYPES = (*DTYPES, "int8")


KV_CACHE_DTYPES = DTYPES   # models/step/kv_cache.py


def parse_kv_cache_dtype(text: str) -> str:
    """vLLM's --kv-cache-dtype: auto, or a float width of the cache."""
    value = text.strip().lower()
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return value


def parse_compute_dtype(text: str) -> str:
    """--compute-dtype: a width of DTYPES, or int8 (activations of quantized weights)."""
    value = text.strip().lower()
    if value not in COMPUTE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return value
NUMERICS = ("ieee", "spyre")
SPYRE_NUMERICS = "dlfloat16"   # the width --numerics spyre computes in


def parse_numerics(text: str) -> str:
    """--numerics: ieee (the host's formats, as --dtype says) or spyre (the card's)."""
    value = text.strip().lower()
    if value not in NUMERICS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(NUMERICS)}")
    return value


def choice_of(*choices: str) -> Callable[[str], str]:
    """A parser of one of ``choices`` (case and spaces aside), refused as argparse refuses."""
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return value
    return parse


parse_policy = choice_of("fcfs", "priority")             # --scheduling-policy (server/sched/waiting.py)
parse_runner = choice_of("auto", "generate", "pooling")  # --runner (models/build.py)
POOLER_KEYS = ("pooling_type", "normalize")
# device.kernels.pooling.POOLING_TYPES' names (not imported: no kernel module may load before
# device.process.configure(); tests/server/launch/test_settings.py checks they agree)
POOLING_TYPES = ("LAST", "MEAN", "CLS")


def parse_pooler_config(text: str) -> dict:
    """--pooler-config: a JSON object of ``pooling_type`` (LAST, MEAN or CLS) and ``normalize``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--pooler-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--pooler-config must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(POOLER_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"--pooler-config: {', '.join(unknown)} not supported "
                                         f"(give {', '.join(POOLER_KEYS)})")
    kind = value.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
        raise argparse.ArgumentTypeError(f"--pooler-config: pooling_type {kind!r} is not one of "
                                         f"{', '.join(POOLING_TYPES)}")
    if "normalize" in value and not isinstance(value["normalize"], bool):
        raise argparse.ArgumentTypeError(f"--pooler-config: normalize must be true or false, "
                                         f"got {value['normalize']!r}")
    return value


QUANTIZATIONS = ("none", "int8", "fp8")   # models/checkpoints/quantize.py's (not imported:
                                          # tests/server/launch/test_settings.py checks)


def parse_quantization(text: str) -> str | None:
    """vLLM's --quantization: none, or a method models/checkpoints/quantize.py applies at load."""
    value = text.strip().lower()
    if value not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(QUANTIZATIONS)}")
    return None if value == "none" else value
JINJA_CHARS = "{}\n"  # a --chat-template holding one of these is a template, not a path


def chat_template_text(value: str) -> str:
    """``--chat-template`` as vLLM reads it: the file it names, else the template itself; a
    value without Jinja's characters that names no readable file is refused (ValueError),
    since it was meant as a path."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name, undecodable text
        if not any(c in value for c in JINJA_CHARS):
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it could not be read: "
                             f"{why}") from None
        return value


def parse_generation_config(text: str) -> str:
    """``--generation-config``: auto, vllm, or a directory that holds a generation_config.json."""
    if text in ("auto", "vllm") or os.path.isfile(os.path.join(text, "generation_config.json")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not auto, vllm or a directory holding a generation_config.json")


def parse_chat_template(text: str) -> str:
    """A ``--chat-template`` that reads (``chat_template_text``), kept as given."""
    try:
        chat_template_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _flag(default, help: str, parse: Callable[[str], object] = str, sizing: bool = False,
          secret: bool = False, nargs: str | None = None):
    """A Settings field; `secret`: its value (from the flag or the environment) is never
    shown, in --help or anywhere else; `nargs`: argparse's (a flag of several values)."""
    return field(default=default, metadata={"help": help, "parse": parse, "sizing": sizing, "secret": secret,
                                            "nargs": nargs})


@dataclass(slots=True)
class Settings:
    """What ``serve`` needs; one field per flag (``warmup`` takes the ``sizing`` ones)."""

    model: str = _flag("granite-tiny", "a model name (granite-tiny, smollm2-135m-instruct), a "
                       "checkpoint directory (Hugging Face format) or a .gguf file", sizing=True)
    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(8000, "TCP port to listen on", int)
    served_model_name: str | None = _flag(None, "model name clients use (default: the --model name)")
    max_num_seqs: int = _flag(32, "most sequences in one step (running requests)", int, sizing=True)
    # vLLM's CPU budget: a burst of prompts is prefilled in a few big steps (docs/performance.md,
    # "A burst of prompts"; SmolLM2-135M bf16 on Zen 4, 8 and 32 concurrent 128-token prompts,
    # against 512: 1.19x / 1.06x the tok/s, ITL p99 27 / 81 ms against 119 / 120)
    max_num_batched_tokens: int = _flag(2048, "token budget of one step (prefill chunk size)", int,
                                        sizing=True)
    # SmolLM2-135M fp32, 32 concurrent 128-token prompts, 512 budget: no cap: ITL p99 843 ms =
    # 5.2x TPOT p50; 128: 2.3x. Only streams past their first tokens are protected
    # (server/sched/prefill_budget.py): a burst's first prompts do not cap the rest of it
    max_prefill_tokens_with_decodes: int | None = _flag(
        128, "most prompt tokens a step may take beside the decodes of streams already flowing "
        "(past their first 8 tokens); smaller keeps them from waiting on prefill chunks "
        "(inter-token latency), at some TTFT and throughput", int)
    dtype: str = _flag("auto", "width of the weights on the card: auto (the checkpoint's), float32, "
                       "bfloat16, float16 or dlfloat16 (the card's own 16-bit format); 16-bit weights "
                       "multiply 16-bit inputs (--compute-dtype auto)", parse_dtype, sizing=True)
    numerics: str = _flag("ieee", "ieee: compute in the host's formats (--dtype); spyre: as the card "
                          "computes, weights, GEMM inputs and KV cache in IBM's DLFloat16 (1 sign, 6 "
                          "exponent, 9 fraction bits, no subnormals), sums in float32: --dtype, "
                          "--kv-cache-dtype dlfloat16 (integer-quantized weights keep int8 inputs)",
                          parse_numerics, sizing=True)
    compute_dtype: str = _flag("auto", "format of GEMM inputs: auto (int8 for 8- and 4-bit weights, "
                               "as llama.cpp; else the weights' width, as vLLM's --dtype), float32 "
                               "to keep activations exact (16-bit weights widened, quantized ones "
                               "on their dequantized values), bfloat16/float16/dlfloat16 with weights "
                               "of that width, or int8 (activations quantized per block of 32 for the "
                               "integer dot products of quantized weights)", parse_compute_dtype,
                               sizing=True)
    quantization: str | None = _flag(None, "weights quantized at load: none, int8 (symmetric, per "
                                     "output channel; served by the card's 8-bit GEMM) or fp8 (E4M3, "
                                     "a scale per output channel, float inputs); a GGUF file's "
                                     "Q8_0/Q4_0/Q4_1 matrices are served at their width without it",
                                     parse_quantization, sizing=True)
    kv_cache_dtype: str = _flag("auto", "storage of the KV cache: auto (float32 with float32 compute, "
                                "else 16 bits: the compute's width, bfloat16 beside int8), float32, "
                                "bfloat16, float16 or dlfloat16 (half the bytes a token: more blocks, and half "
                                "the memory traffic of attention)", parse_kv_cache_dtype, sizing=True)
    runner: str = _flag("auto", "generate (completions and chats), pooling (embeddings and scores: "
                        "/v1/embeddings, /score), or auto: pooling for an encoder checkpoint (RoBERTa's "
                        "family), else generate (vLLM's)", parse_runner, sizing=True)
    pooler_config: dict | None = _flag(None, "a pooling runner's pooling, as JSON: {\"pooling_type\": "
                                       "LAST|MEAN|CLS, \"normalize\": true|false} (default: the model's, "
                                       "as vLLM's)", parse_pooler_config, sizing=True)
    block_size: int = _flag(64, "tokens per KV cache block", int, sizing=True)
    tensor_parallel_size: int = _flag(1, "emulated cards a model is sharded over (vLLM's; each --device-memory "
                                      "big, its own stream and share of the cores; a float checkpoint of a "
                                      "generating model); `spyre-serve plan` sizes and projects them", int,
                                      sizing=True)
    num_kv_blocks: int | None = _flag(None, "KV cache blocks (default: what fits in 90%% of the free "
                                      "device memory)", int, sizing=True)
    max_model_len: int | None = _flag(None, "context length (default: the model's, capped by the KV "
                                      "cache)", int, sizing=True)
    device_memory: int | None = _flag(None, "emulated card memory, bytes or e.g. 2G (default: sized "
                                      "for this machine)", parse_size, sizing=True)
    api_key: str | None = _flag(None, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, "
                                "/detokenize (an empty key is refused)", secret=True)
    guard_metrics_and_docs: bool = _flag(False, "with --api-key, require the key on /metrics, /docs, "
                                         "/redoc and /openapi.json too (/health, /ping and /version stay "
                                         "open for load balancers)", parse_bool)
    strict_request_fields: bool = _flag(False, "refuse (400, naming it) a request field this server does not "
                                        "know; by default such a field is ignored and named in a warning "
                                        "line, as vLLM does (routers add fields of their own to every body)",
                                        parse_bool)
    max_waiting: int = _flag(1024, "most sequences (every choice of every prompt) waiting for "
                             "admission; a request that would go over gets 503 + Retry-After, one "
                             "that alone is over gets 400", int)
    max_n: int = _flag(8, "largest n (choices per prompt) a request may ask for", int)
    max_prompts: int = _flag(256, "most prompts in one completion request (a list of strings or of "
                             "token-id lists)", int)
    max_scored_prompt_tokens: int = _flag(8192, "most prompt tokens one request may have scored (echo "
                                          "with logprobs, prompt_logprobs): its prompts' tokens x n", int)
    max_scored_tokens_per_step: int = _flag(256, "most prompt tokens one step scores (each a row of the "
                                            "vocabulary read back from the card); prompt-logprob "
                                            "chunks are cut to fit", int)
    max_schema_bytes: int = _flag(16384, "largest JSON schema of structured output (response_format, "
                                  "guided_json, structured_outputs), as JSON text", parse_size)
    max_tools: int = _flag(128, "most functions in a chat's tools", int)
    max_tools_bytes: int = _flag(131072, "largest tools list of a chat, as JSON text", parse_size)
    max_stored_responses: int = _flag(1000, "most responses the Responses API keeps (store: true, its "
                                      "default) for GET /v1/responses/ID and previous_response_id, in "
                                      "this API process's memory; the oldest is dropped first; 0 keeps "
                                      "none", int)
    max_stop_strings: int = _flag(32, "most stop strings in one request", int)
    max_stop_length: int = _flag(256, "longest stop string, in characters", int)
    max_stop_token_ids: int = _flag(64, "most stop_token_ids in one request", int)
    chat_template: str | None = _flag(None, "Jinja chat template to use instead of the tokenizer's: "
                                      "a file, or the template itself", parse_chat_template)
    generation_config: str = _flag("auto", "sampling defaults for what a request leaves unset (temperature, "
                                   "top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens): "
                                   "auto (the model's generation_config.json), vllm (none), or a directory "
                                   "holding a generation_config.json", parse_generation_config)
    render_timeout: float = _flag(5.0, "seconds a request's chat template may take to render (and "
                                  "its prompt to tokenize), off the event loop; longer is a 400", float)
    offload_wait: float = _flag(1.0, "seconds a request waits for one of the threads that render and "
                                "tokenize when all are busy; then 503 + Retry-After", float)
    max_body_bytes: int = _flag(1 << 20, "largest request body; larger gets 413", parse_size)
    limit_concurrency: int = _flag(2048, "most connections and requests open at once (uvicorn's "
                                   "limit): past it a new one gets 503 before any work", int)
    drain_timeout: float = _flag(30.0, "seconds from SIGTERM to exit: running requests finish, and "
                                 "those still running 2 s before the end are cut (a stream ends with "
                                 "an error event)", float)
    stream_send_timeout: float = _flag(30.0, "seconds a stream's client may leave its events unread "
                                       "while more arrive; then the request is aborted and its KV "
                                       "blocks freed", float)
    step_timeout: float = _flag(120.0, "seconds a step may take before the engine is declared dead "
                                "(in-flight requests fail, the server exits 1 to be restarted)", float)
    enable_prefix_caching: bool = _flag(True, "reuse the KV blocks of a prompt prefix computed before "
                                        "(full blocks, content-addressed, least recently used "
                                        "evicted first)", parse_bool)
    scheduling_policy: str = _flag("fcfs", "fcfs: requests run in arrival order; priority: by the request's "
                                   "priority (lower first, then arrival), a waiting request taking the "
                                   "slot of a running one of lower priority (vLLM's)", parse_policy)
    spyre_compat: bool = _flag(False, "schedule and admit as the vLLM Spyre plugin does "
                               "(server/sched/spyre_compat.py): "
                               "one prefill at a time, never beside decodes; prefill chunks of "
                               "--max-num-batched-tokens (a multiple of 64, --block-size 64); batch x "
                               "max context <= 131072; 32K context at most; prefix-cache hits in whole "
                               "chunks; --no-warmup refused", parse_bool)
    speculative_config: SpeculativeConfig | None = _flag(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_max\": 5, \"prompt_lookup_min\": 5, \"disable_by_batch_size\": 16} (tokens looked up "
        "in the sequence's own context) or {\"model\": DIR, \"num_speculative_tokens\": k} (a draft model "
        "on the same card): a decode verifies up to k proposed tokens in one step (server/spec_decode/proposals.py); "
        "the output is the same as without", SpeculativeConfig.parse)
    structured_output_wait: bool = _flag(False, "structured output: read back a step holding a grammar's "
                                         "sample before planning the next (every sequence gets a token "
                                         "each step, the card idles while the host plans) instead of "
                                         "running grammar sequences every other step beside the overlap",
                                         parse_bool)
    engine_process: bool = _flag(True, "run the engine (the card, the scheduler, the step loop) in a "
                                 "process of its own, as vLLM's engine core, so that HTTP, JSON, "
                                 "tokenizing and templates never take its GIL; false: one process",
                                 parse_bool)
    api_server_count: int = _flag(1, "API processes serving HTTP on the one port (vLLM's), each "
                                  "with its own event loop and threads, all before one engine "
                                  "process (needs --engine-process)", int)
    enable_lora: bool = _flag(False, "serve LoRA adapters beside the base model (vLLM's): a request names "
                              "one in its \"model\"", parse_bool, sizing=True)
    lora_modules: tuple | None = _flag(None, "adapters served from the start: NAME=PATH (a PEFT adapter "
                                       "directory) ... or vLLM's JSON {\"name\", \"path\"}",
                                       parse_lora_module, nargs="+")
    max_loras: int = _flag(1, "adapters on the card at once (slots placed at start; more are swapped "
                           "in least recently used first, never one a running request uses)", int, sizing=True)
    max_lora_rank: int = _flag(16, "largest rank of an adapter (every slot is this rank)", int, sizing=True)
    max_cpu_loras: int | None = _flag(None, "adapters kept in host memory (vLLM's; default --max-loras): "
                                      "the least recently used are dropped and read again from their "
                                      "directory when a request needs one", int)
    allow_runtime_lora: bool = _flag(False, "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING)", parse_bool)
    allowed_lora_root: tuple | None = _flag(None, "directories a runtime load may read adapters from, on their "
                                            "real paths (default: the directories holding the --lora-modules "
                                            "adapters; the variable joins several with ':')", parse_lora_root,
                                            nargs="+")
    warmup: bool = _flag(True, "compile and prepare every step program before listening", parse_bool)
    log_level: str = _flag("info", "debug, info, warning or error", sizing=True)

    def with_numerics(self) -> Settings:
        """These settings checked (an empty API key is refused, --spyre-compat's rules:
        ``server/sched/spyre_compat.py``; ValueError) and with
        ``--numerics`` applied: spyre sets the weights' and the KV
        cache's widths (and the GEMM inputs' through --compute-dtype auto) to DLFloat16; a
        width given as something else contradicts it (ValueError naming both)."""
        if self.api_server_count < 1 or (self.api_server_count > 1 and not self.engine_process):
            raise ValueError(f"--api-server-count {self.api_server_count}: give 1, or more with "
                             "--engine-process (the API processes share one engine process)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty (or SPYRE_SERVE_API_KEY is set to nothing): an "
                             "empty bearer token would pass it; set a key or leave it unset")
        if self.spyre_compat:
            check_settings(self)
        check_lora_settings(self)
        if self.numerics == "ieee":
            return self
        for name in ("dtype", "compute_dtype", "kv_cache_dtype"):
            value = getattr(self, name)
            if value not in ("auto", SPYRE_NUMERICS):
                raise ValueError(f"--numerics spyre computes in {SPYRE_NUMERICS}; "
                                 f"--{name.replace('_', '-')} {value} contradicts it")
        return replace(self, dtype=SPYRE_NUMERICS, kv_cache_dtype=SPYRE_NUMERICS)

    def one_card(self) -> Settings:
        """These settings, once they ask for one card (ValueError otherwise: ``warmup`` prepares
        one card's programs, which every card of ``serve --tensor-parallel-size`` shares)."""
        if self.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: warmup prepares one card's "
                             "programs (the cards of a sharded server share them)")
        return self

    def served_name(self, model) -> str:
        """What clients put in ``"model"``: --served-model-name, else the loaded model's name."""
        return self.served_model_name or model.name


# The flags `warmup` takes: what decides the programs and the memory plan.
SIZING = tuple(f.name for f in fields(Settings) if f.metadata["sizing"])


def add_flags(parser: argparse.ArgumentParser, names: list[str] | tuple[str, ...]) -> None:
    """One flag per Settings field named; its default is the environment's value if set there.

    An environment value is handed to argparse as a string default, which argparse parses
    as it would the flag's text: a bad value is refused naming the flag, as on the command
    line. A flag given on the command line wins."""
    by_name = {f.name: f for f in fields(Settings)}
    for name in names:
        f = by_name[name]
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        env_value = os.environ.get(env)
        help_text = f"{f.metadata['help']} [env {env}]"
        parse = f.metadata["parse"]
        if f.metadata["secret"]:         # the environment's value is read after parsing
            parser.add_argument(flag, type=parse, default=None, metavar=name.upper(),
                                help=f"{f.metadata['help']} [env {env}; never shown]")
            continue
        if parse is parse_bool:
            default = parse_bool(env_value) if env_value is not None else f.default
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        parser.add_argument(flag, type=parse, default=env_value if env_value is not None else f.default,
                            help=help_text, metavar="NAME|DIR|GGUF" if name == "model" else name.upper(),
                            nargs=f.metadata["nargs"])


def secrets_from_env(values: dict) -> dict:
    """``values`` (field name -> parsed value) with each secret field not given as a flag
    taken from its environment variable (add_flags leaves those out of --help)."""
    for f in fields(Settings):
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if f.metadata["secret"] and values.get(f.name) is None and env is not None:
            values[f.name] = f.metadata["parse"](env)
    return values
