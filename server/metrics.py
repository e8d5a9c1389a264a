"""Prometheus metrics: vLLM's names and meanings, and the card's own under ``spyre_``.

Counters and histograms are fed by the engine (``EngineObserver`` hooks, on
the engine thread); gauges are read from the engine and the card when
``/metrics`` is scraped. Each app has its own registry, so several servers
can live in one process (tests).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from spyre_serve.server.engine.core import Engine, EngineObserver

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
ENGINE_ALIVE_HELP = "1 while the engine loop runs."  # the engine's gauge, or the API's when it is down
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# a step on a real card (models/sizing/projection.py): from a small model's decode to a long prefill
PROJECTED_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                          0.25, 0.5, 1.0, 2.5, 5.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class Metrics(EngineObserver):
    def __init__(self, model_name: str, card=None, compiles_at_ready: int | list | None = None,
                 max_model_len: int = 1 << 20) -> None:
        self.model_name = model_name
        self.card = card
        self.cards: list = []     # every card of a sharded model (card 0 first): set by the CLI
        self.compiles_at_ready = compiles_at_ready
        self.engine: Engine | None = None
        self.offload = None   # the API's worker threads (server/openai/offload.py), once watched
        self.requests = None  # the API's request counts (server/openai/request_counts.py), once watched
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", labels + ["finished_reason"],
            registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
            buckets=E2E_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", labels,
            buckets=E2E_BUCKETS, registry=r,
        )
        self.max_tokens_param = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", labels,
            buckets=buckets_1_2_5(max_model_len), registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels,
            buckets=ITERATION_TOKENS_BUCKETS, registry=r,
        )
        self.projected_step = Histogram(
            "spyre_projected_step_seconds", "Histogram of each launched step's seconds on a real Spyre "
            "card, projected from its shape (models/sizing/projection.py).", labels,
            buckets=PROJECTED_STEP_BUCKETS, registry=r,
        ).labels(model_name)     # its series from the start: 0 until a step is projected
        r.register(_LiveCollector(self))

    def watch(self, engine: Engine) -> None:
        """Read the gauges from `engine` (built with this as its observer: it feeds the rest)."""
        if engine.observer is not self:
            raise ValueError("Metrics.watch: build the engine with observer=metrics first")
        self.engine = engine

    def watch_offload(self, offload, requests=None) -> None:
        """Report `offload`'s pool (an ``Offload``: stats()) in the gauges too, and `requests`
        (a ``RequestCounts``) when given."""
        self.offload, self.requests = offload, requests

    # ---- EngineObserver (engine thread) ----
    def on_scheduled(self, queue_seconds: float, num_prompt_tokens: int) -> None:
        self.queue_time.labels(self.model_name).observe(queue_seconds)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_tokens(self, n: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(n)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def on_finished(self, reason: str, e2e_seconds: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_seconds)

    def on_step(self, num_tokens: int) -> None:
        self.iteration_tokens.labels(self.model_name).observe(num_tokens)

    def on_request_params(self, max_tokens: int) -> None:
        self.max_tokens_param.labels(self.model_name).observe(max_tokens)

    def on_projected_step(self, seconds: float) -> None:
        self.projected_step.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def render_async(self) -> tuple[bytes, str]:
        return self.render()


class ApiMetrics:
    """/metrics of an API process whose engine runs in its own process: the engine process's
    metrics (asked for over its pipe, ``EngineProcessClient.metrics_text``) and this process's own (the
    worker threads). When the engine process does not answer, ``spyre_engine_alive`` is 0."""

    def __init__(self, client, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.offload = self.requests = None
        self.engine_down = False   # the engine process did not answer the scrape being rendered
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ApiCollector(self))

    def watch_offload(self, offload, requests=None) -> None:
        self.offload, self.requests = offload, requests

    async def render_async(self) -> tuple[bytes, str]:
        engine = await self.client.metrics_text()
        self.engine_down = not engine     # read by _ApiCollector below, with no await between
        return engine + generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ApiCollector:
    """The API process's own families: its worker threads, and the engine's 0 when it is down."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        if self.m.engine_down:
            alive = GaugeMetricFamily("spyre_engine_alive", ENGINE_ALIVE_HELP, labels=["model_name"])
            alive.add_metric([self.m.model_name], 0.0)
            yield alive
        yield from offload_families(self.m.model_name, self.m.offload, self.m.requests)


def offload_families(model_name: str, offload, requests=None):
    """The gauges of the API's worker threads (``server/openai/offload.py``; none without them)
    and its request counts (``server/openai/request_counts.py``)."""
    if requests is not None:
        yield from requests.families(model_name)
    if offload is None:
        return
    pool = offload.stats()
    for metric, doc, value, kind in (
        ("spyre_api_offload_workers", "Threads that render chat templates and tokenize.", pool["workers"], "g"),
        ("spyre_api_offload_busy", "Of them, busy now (a stuck one until its thread ends).", pool["busy"], "g"),
        ("spyre_api_offload_waiting", "Requests waiting for one of them.", pool["waiting"], "g"),
        ("spyre_api_offload_refused", "Requests refused (503) after --offload-wait with every thread busy.",
         pool["refused"], "c"),
    ):
        family = (GaugeMetricFamily if kind == "g" else CounterMetricFamily)(metric, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family


class _LiveCollector:
    """Gauges read at scrape time from the engine and the card."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m, engine, card = self.m, self.m.engine, self.m.card
        name = [m.model_name]

        def gauge(metric: str, doc: str, value: float):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        if engine is not None:
            yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                        engine.num_running_requests)
            yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                        engine.num_waiting_requests)
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.blocks.usage)
            yield cache_config_info(engine)
            lora = getattr(engine.runner, "lora", None)
            if lora is not None:
                yield lora_requests_info(lora.max_loras, *engine.lora_adapters)
            yield gauge("spyre_kv_blocks_total", "KV cache blocks on the card.", engine.blocks.num_blocks)
            yield gauge("spyre_kv_blocks_free", "KV cache blocks free right now.", engine.blocks.num_free)
            yield counter("spyre_preemptions", "Sequences preempted (blocks freed, recomputed later).",
                          engine.scheduler.num_preemptions)
            yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                          engine.scheduler.num_preemptions)
            cache = engine.blocks.stats
            yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                          "queried tokens.", cache.queries)
            yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                          "tokens.", cache.hits)
            yield gauge("spyre_kv_blocks_cached", "KV cache blocks holding a cached prefix block (in use "
                        "or free).", engine.blocks.num_cached)
            stats = engine.stats
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          stats.spec_accepted_tokens)
            yield counter("spyre_engine_steps", "Steps launched by the engine.", engine.stats.steps)
            yield counter("spyre_engine_failed_steps", "Steps that raised; only the requests at fault failed.",
                          engine.stats.failed_steps)
            busy = engine.stats.device_busy_fraction
            yield gauge("spyre_device_busy_fraction",
                        "Device compute time over wall time while the engine had work.", busy)
            yield gauge("spyre_device_idle_fraction", "1 - spyre_device_busy_fraction.", 1.0 - busy
                        if engine.stats.busy_wall_seconds > 0 else 0.0)
            yield gauge("spyre_engine_alive", ENGINE_ALIVE_HELP, 1.0 if engine.alive else 0.0)
            held = getattr(engine.runner, "held", None)
            if held is not None:
                yield gauge("spyre_runner_held_sequences", "Sequences the model runner keeps state for "
                            "between steps (prompt-logprob rows, penalty slots); 0 when idle.",
                            float(sum(held().values())))
        yield from offload_families(m.model_name, m.offload, m.requests)
        from spyre_serve.device.isa import current

        kernel_isa = current()
        isa = GaugeMetricFamily("spyre_kernel_isa", "The vector ISA level the card's kernels are "
                                "compiled for (1 on the level in use; device/isa.py).",
                                labels=["model_name", "isa", "host_isa"])
        isa.add_metric([m.model_name, kernel_isa.level, kernel_isa.host_level], 1.0)
        yield isa
        if card is not None:
            yield from card_families(m.model_name, m.cards or [card], m.compiles_at_ready)


def cache_config_info(engine: Engine) -> GaugeMetricFamily:
    """vLLM's ``vllm:cache_config_info``: the KV cache's configuration as labels, value 1 (the
    Inference Extension's model-server protocol reads ``block_size`` and ``num_gpu_blocks``)."""
    runner = engine.runner
    config = {"block_size": engine.block_size, "num_gpu_blocks": engine.num_kv_blocks, "num_cpu_blocks": None,
              "cache_dtype": getattr(runner, "kv_cache_dtype", "auto"),
              "enable_prefix_caching": engine.blocks.enable_caching, "engine": 0}
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                               labels=list(config))
    family.add_metric([str(v) for v in config.values()], 1.0)
    return family


def lora_requests_info(max_loras: int, running: list[str], waiting: list[str]) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``: the adapters of running and waiting requests
    (comma-separated) and how many fit on the card at once, as labels; its value the time of
    the reading (vLLM's: the last update)."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    family.add_metric([str(max_loras), ",".join(running), ",".join(waiting)], time.time())
    return family


def card_families(model_name: str, cards: list, compiles_at_ready):
    """The cards' counters and memory: one sample a card, labelled ``card`` when there are
    several (``--tensor-parallel-size``: spyre-smi prints each label set as a card).
    ``compiles_at_ready``: each card's compile count at warm-up's end (an int for one card)."""
    several = len(cards) > 1
    labels = ["model_name", "card"] if several else ["model_name"]
    ready = compiles_at_ready if isinstance(compiles_at_ready, list) else [compiles_at_ready]
    snaps = [(c.counters.snapshot(), c.allocator.stats()) for c in cards]

    def family(kind, metric: str, doc: str, value_of):
        f = (CounterMetricFamily if kind == "c" else GaugeMetricFamily)(metric, doc, labels=labels)
        for i, snap in enumerate(snaps):
            f.add_metric([model_name, str(i)] if several else [model_name], value_of(i, *snap))
        return f

    yield family("c", "spyre_launches", "Program launches on the card.", lambda i, c, s: c.get("launches", 0))
    yield family("c", "spyre_compiles", "Program compilations in this process.", lambda i, c, s: c.get("compiles", 0))
    if ready[0] is not None:
        yield family("g", "spyre_compiles_after_warmup", "Compilations since warm-up finished (stays 0).",
                     lambda i, c, s: c.get("compiles", 0) - ready[min(i, len(ready) - 1)])
    yield family("c", "spyre_device_compute_seconds", "Time the card spent computing.",
                 lambda i, c, s: c.get("compute_seconds", 0.0))
    yield family("c", "spyre_h2d_bytes", "Bytes copied host to device.", lambda i, c, s: c.get("h2d_bytes", 0))
    yield family("c", "spyre_d2h_bytes", "Bytes copied device to host.", lambda i, c, s: c.get("d2h_bytes", 0))
    yield family("g", "spyre_device_memory_used_bytes", "Device memory allocated.", lambda i, c, s: s.allocated)
    yield family("g", "spyre_device_memory_peak_bytes", "Peak device memory allocated.", lambda i, c, s: s.peak)
    yield family("g", "spyre_device_memory_total_bytes", "Device memory of the card.", lambda i, c, s: s.capacity)
