"""``spyre-serve``: the command line.

    spyre-serve serve [--model granite-tiny] [--host 127.0.0.1] [--port 8000] ...
    spyre-serve warmup [--model granite-tiny] [--max-num-seqs 32] ...   (the sizing flags)
    spyre-serve plan --model granite-3.3-8b --tensor-parallel-size 4 ... (server/launch/plan.py)

Every flag can also come from an environment variable (``--max-num-seqs`` from
``SPYRE_SERVE_MAX_NUM_SEQS``, and so on) so a container is configured without
a command line; a flag given on the command line wins (the flags, their defaults and
help are one table, ``server/launch/settings.py``). ``build()`` is what
``serve`` runs before listening, and what the end-to-end tests run too.
``warmup`` loads the model, compiles and prepares every step program (filling
Numba's on-disk cache, ``NUMBA_CACHE_DIR``), prints them and the memory plan,
and exits: the Docker image runs it at build time.

``serve`` exits 0 after a SIGTERM/SIGINT drain, and 1 when the engine dies (an error
outside a step, or a step that did not return within ``--step-timeout``): the engine has
answered every in-flight request with an error, uvicorn stops, and the process exits so
that compose or Kubernetes restarts the replica rather than leave it answering 503.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, fields

from spyre_serve.server.launch import streams
from spyre_serve.server.launch.settings import (
    ENV_PREFIX,
    SIZING,
    Settings,
    add_flags,
    secrets_from_env,
)

log = logging.getLogger("spyre_serve")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spyre-serve",
        description="OpenAI-compatible inference server for IBM Granite models on an emulated Spyre card.",
        epilog=f"Every flag may be set from the environment: --max-num-seqs from {ENV_PREFIX}MAX_NUM_SEQS, etc.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="load a model and serve the OpenAI API over HTTP",
        description="Load a model onto the emulated card, compile its step programs, and serve "
        "/v1/completions, /v1/chat/completions, /v1/models, /health, /ping, /version, /tokenize, /detokenize, "
        "/metrics.",
        epilog=f"Environment: each flag as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}MODEL, {ENV_PREFIX}PORT, "
        f"{ENV_PREFIX}API_KEY); a flag on the command line wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(serve, [f.name for f in fields(Settings)])
    warmup = sub.add_parser(
        "warmup",
        help="compile and prepare every step program into the on-disk cache, then exit",
        description="Load a model onto the emulated card, compile (or load from Numba's cache, "
        "NUMBA_CACHE_DIR) and prepare the step program of every (tokens, sequences) bucket, run "
        "each token bucket once, print the programs and the memory plan, and exit 0. A later "
        "`serve` on the same machine and cache then starts without compiling (a Docker build "
        "runs this).",
        epilog=f"Environment: each flag as {ENV_PREFIX}<FLAG>, as for serve; a flag on the command line wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(warmup, SIZING)
    plan = sub.add_parser(
        "plan", help="will a model fit, card by card: weights, KV cache, buffers (from its config alone)",
        description="From a model's config alone (granite-3.3-8b, a profile, a checkpoint directory, a "
        "config.json or a GGUF file), print what each of --tensor-parallel-size cards holds and what is left "
        "of a 128 GB card; exit 1 when it does not fit.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(plan, SIZING)
    return parser


def parse_command(argv: list[str] | None = None) -> tuple[str, Settings]:
    """("serve" | "warmup" | "plan", its Settings); flags a command does not take keep their defaults."""
    args = _parser().parse_args(argv)
    defaults = Settings()
    values = secrets_from_env({f.name: getattr(args, f.name, getattr(defaults, f.name))
                               for f in fields(Settings)})
    try:
        s = Settings(**values).with_numerics()
        return args.command, s if args.command in ("plan", "serve") else s.one_card()
    except ValueError as exc:
        _parser().error(str(exc))


def parse_args(argv: list[str] | None = None) -> Settings:
    return parse_command(argv)[1]


@dataclass(slots=True)
class Built:
    app: object
    engine: object
    runner: object
    card: object
    model: object
    metrics: object


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(slots=True)
class Loaded:
    engine: object
    runner: object
    card: object
    model: object
    metrics: object


def load_engine(s: Settings, progress: bool = True) -> Loaded:
    """Card, model, runner (warmed up), metrics and engine (started): what the engine's process
    runs (``server/engine/process.py``), or ``build`` in one process."""
    from spyre_serve.models import build_runner
    from spyre_serve.server.engine.core import Engine
    from spyre_serve.server.engine.watchdog import Fault
    from spyre_serve.server.lora.adapters import lora_modules
    from spyre_serve.server.metrics import Metrics
    from spyre_serve.server.sched.spyre_compat import for_engine
    from spyre_serve.server.spec_decode.proposals import speculator_for

    t0 = time.monotonic()
    from spyre_serve.device.isa import current

    log.info("kernels compiled for %s", current().describe())
    built = build_runner(s, lora_modules(s.lora_modules))   # card 0 of --tensor-parallel-size
    card, model, runner, draft = built.card, built.model, built.runner, built.draft
    cfg = model.config
    log.info("model %s (%s) from %s: %d layers, hidden %d, %d heads (%s KV), vocab %d, stored %s",
             model.name, cfg.architecture, model.path, cfg.num_hidden_layers, cfg.hidden_size,
             cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", "no"), cfg.vocab_size,
             model.stored_dtype)
    compat = for_engine(s, runner)   # --spyre-compat: the plugin's rules (refused at start: ValueError)
    prefix_caching = s.enable_prefix_caching
    if prefix_caching and getattr(cfg, "mamba_layers", None):
        prefix_caching = False
        log.info("prefix caching is off for %s: its Mamba-2 layers keep a state per sequence, not per KV "
                 "block, and a cached prefix would skip the tokens that state is made of", cfg.architecture)
    log.info("weights on the card: %s (float tensors %s), GEMM inputs in %s, KV cache in %s",
             ", ".join(sorted(model.weights.formats)), model.weights.dtype, runner.compute_dtype,
             runner.kv_cache_dtype)
    log.info("%s", memory_plan_text(card, model, runner))
    if s.warmup:
        shapes = runner.bucket_shapes()
        log.info("compiling and preparing %d step programs (token buckets %s)", len(shapes), runner.t_buckets)
        runner.warmup(progress=progress)
        if draft is not None:
            draft.warmup(progress=progress)
    cards = getattr(runner, "cards", [card])          # a sharded model's every card
    metrics = Metrics(s.served_name(model), card=card, max_model_len=runner.max_model_len,
                      compiles_at_ready=[c.counters.snapshot()["compiles"] for c in cards])
    metrics.cards = cards
    engine = Engine(runner, model.tokenizer, observer=metrics, fault=Fault.from_env(),
                    max_num_seqs=s.max_num_seqs,
                    max_num_batched_tokens=s.max_num_batched_tokens, card=card,
                    step_timeout=s.step_timeout, enable_prefix_caching=prefix_caching,
                    max_prefill_with_decodes=s.max_prefill_tokens_with_decodes,
                    max_scored_tokens_per_step=s.max_scored_tokens_per_step,
                    scheduling_policy=s.scheduling_policy, spyre_compat=compat,
                    structured_output_wait=s.structured_output_wait, speculator=speculator_for(s, runner, draft))
    metrics.watch(engine)
    engine.start()
    log.info("engine ready in %.1f s: max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, "
             "%d programs", time.monotonic() - t0, runner.max_model_len, s.max_num_seqs,
             s.max_num_batched_tokens, len(runner.programs))
    return Loaded(engine, runner, card, model, metrics)


def build(s: Settings, progress: bool = True, conn=None) -> Built:
    """The engine (``load_engine``: in this process, or with ``--engine-process`` in its own,
    ``server/engine/client.py``; ``conn``: a pipe to one a sibling started, --api-server-count),
    its metrics and the app."""
    s = s.with_numerics()
    from spyre_serve.server.openai.app import create_app

    if s.engine_process:
        from spyre_serve.server.engine.client import build_api

        engine, model, metrics = build_api(s, conn)
        loaded = Loaded(engine, None, None, model, metrics)
    else:
        loaded = load_engine(s, progress)
    app = create_app(loaded.engine, loaded.model, s, loaded.metrics)
    loaded.metrics.watch_offload(app.state.serving.offload, app.state.request_counts)
    return Built(app, loaded.engine, loaded.runner, loaded.card, loaded.model, loaded.metrics)


def memory_plan_text(card, model, runner) -> str:
    """One line: the card, the weights, the KV cache, the runner's scratch and I/O, what is in use."""
    plan = runner.memory_plan
    formats = ", ".join(f"{name} {_mb(n)}" for name, n in
                        sorted(model.weights.formats.items(), key=lambda kv: -kv[1]))
    return (f"memory plan on a {_mb(card.memory.nbytes)} card: weights {_mb(model.weights.nbytes)} "
            f"(matrices: {formats}), "
            f"KV cache {_mb(plan['kv_cache'])} ({runner.num_kv_blocks} blocks of {runner.block_size} tokens "
            f"= {runner.num_kv_blocks * runner.block_size} tokens), scratch and I/O "
            f"{_mb(plan['workspace'] + plan['io'])} (step workspace {_mb(plan['workspace'])}, "
            f"I/O buffers {_mb(plan['io'])}), layer table {plan['layer_table']} B, "
            + (f"LoRA slots {_mb(plan['lora_arena'])}, " if "lora_arena" in plan else "")
            + f"in use {_mb(card.allocator.stats().allocated)}")


def warmup(s: Settings, progress: bool = True, out=None) -> int:
    """`spyre-serve warmup`: load the model, compile and prepare every step program (Numba
    writes the compiled code to its on-disk cache), print them and the memory plan; 0 when done."""
    s = s.with_numerics().one_card()
    import numba

    from spyre_serve.models import build_runner
    from spyre_serve.server.lora.adapters import lora_modules

    out = out or sys.stdout
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    built = build_runner(s, lora_modules(s.lora_modules), draft=False)
    card, model, runner = built.card, built.model, built.runner
    try:
        cfg = model.config
        print(f"model {model.name} from {model.path}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
              f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} KV), vocab {cfg.vocab_size}, "
              f"stored {model.stored_dtype}", file=out)
        print(memory_plan_text(card, model, runner), file=out)
        shapes = runner.bucket_shapes()
        print(f"compiling and preparing {len(shapes)} step programs (token buckets {runner.t_buckets}, "
              f"sequence buckets {runner.s_buckets}); Numba cache: "
              f"{numba.config.CACHE_DIR}", file=out, flush=True)
        before = card.counters.snapshot()
        t1 = time.monotonic()
        runner.warmup(progress=progress)
        after = card.counters.snapshot()
        for (t, n), prog in sorted(runner.programs.items()):
            print(f"  {prog.name}: tokens {t}, sequences {n}, entry {prog.entry.py_func.__name__}", file=out)
        compiled = after.get("compiles", 0) - before.get("compiles", 0)
        loaded = after.get("cache_loads", 0) - before.get("cache_loads", 0)
        how = ("compiled and written to the cache" if compiled else
               "loaded from the cache" if loaded else "already compiled in this process")
        print(f"{len(runner.programs)} step programs prepared in {time.monotonic() - t1:.1f} s; "
              f"their shared entry was {how} (compiles {compiled}, cache loads {loaded}, "
              f"prepares {after.get('prepares', 0) - before.get('prepares', 0)}, "
              f"padding launches {after.get('launches', 0) - before.get('launches', 0)})", file=out)
        print(f"warm-up done in {time.monotonic() - t0:.1f} s", file=out, flush=True)
    finally:
        built.close()
    return 0


# The last seconds of --drain-timeout: requests still running are cut (their streams end with
# an error event), and uvicorn gets this long to send those last events and close.
FLUSH_SECONDS = 2


class CloseWhileDraining:
    """ASGI wrapper: once ``draining`` is set, the response to every request received after
    that says ``Connection: close``.

    A proxy in front (nginx's keep-alive pool) or a client then holds no idle connection to
    this replica when it exits: a request written on a connection the server is closing fails
    where nobody can retry it (nginx passes a POST on to another replica only if it was not
    sent), while one that finds the port closed is refused and goes elsewhere."""

    def __init__(self, app) -> None:
        self.app = app
        self.draining = False

    async def __call__(self, scope, receive, send):
        # a request that came before the signal passes untouched (no wrapper on its stream's
        # chunks): its connection was open at the signal, and the drain waits for those
        if scope["type"] != "http" or not self.draining:
            return await self.app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        return await self.app(scope, receive, send_closing)


def _draining_server(config, engine, drain_timeout: float, closing: CloseWhileDraining):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """First SIGTERM/SIGINT: stop admitting (503, ``Connection: close``), let running requests
        finish and the connections open at the signal close, then exit 0, all within
        ``drain_timeout`` seconds: at ``drain_timeout - FLUSH_SECONDS`` the requests still
        running are cut (the engine shuts down and answers each with an error: a stream ends
        with an error event and ``[DONE]``), and uvicorn closes within the rest. A second
        signal exits at once.

        The connections open at the signal are the ones a client may still reuse: each is
        closed after its next response (``closing``) or by its client when idle (nginx's
        keepalive_timeout, 4 s) or by uvicorn's keep-alive timeout (5 s), whichever comes first.
        Connections opened during the drain need no wait: their first answer closes them."""

        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                self.force_exit = True
                self.should_exit = True
                return
            self.draining = True
            closing.draining = True
            engine.accepting = False
            log.info("signal %s: draining %d requests (up to %.0f s), admitting none", sig,
                     engine.num_requests, drain_timeout)
            reusable = set(self.server_state.connections)
            threading.Thread(target=self._drain, args=(reusable,), name="drain", daemon=True).start()

        def _drain(self, reusable: set) -> None:
            deadline = time.monotonic() + max(0.0, drain_timeout - FLUSH_SECONDS)
            while engine.num_requests and time.monotonic() < deadline:
                time.sleep(0.05)
            left = engine.num_requests
            if left:
                log.warning("drain timeout: %d requests still running are cut off (each gets an error)", left)
                engine.shutdown(timeout=FLUSH_SECONDS / 2)
            while (reusable & set(self.server_state.connections)) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.should_exit = True

    return DrainingServer(config)


def uvicorn_config(app, s: Settings):
    """uvicorn's configuration for serving ``app``: address, log level, graceful-shutdown
    budget, and the cap on concurrent connections (``--limit-concurrency``: past it uvicorn
    answers 503 at once, before any of the app's work)."""
    import uvicorn

    return uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level,
                          timeout_graceful_shutdown=FLUSH_SECONDS, limit_concurrency=s.limit_concurrency)


def serve(s: Settings) -> int:
    streams.install()     # a full disk under the log drops log lines, never a request
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if s.api_server_count > 1:
            from spyre_serve.server.launch.api_servers import serve_many

            return serve_many(s)
        built = build(s, progress=True)
    except Exception as exc:
        if not refused_at_start(exc):
            raise
        return 2
    log.info("serving %s on http://%s:%d/v1", built.metrics.model_name, s.host, s.port)
    return run(built.app, built.engine, s)


def refused_at_start(exc: Exception) -> bool:
    """A model, checkpoint or flag the server cannot serve (``is_refusal``: the engine process's
    ``StartRefused`` too): one line on stderr, as argparse refuses a bad flag, and True (exit code
    2); the traceback only at --log-level debug. False for anything else."""
    from spyre_serve.server.engine.process import is_refusal

    if not is_refusal(exc):
        return False
    log.debug("start refused", exc_info=exc)
    print(f"spyre-serve serve: error: {exc}", file=sys.stderr)
    return True


def run(app, engine, s: Settings, sockets=None) -> int:
    """Serve ``app`` until a drain ends (0) or ``engine`` dies (1); ``sockets``: listen on
    these (shared by several API processes) instead of binding ``--host``/``--port``."""
    closing = CloseWhileDraining(app)
    config = uvicorn_config(closing, s)
    server = _draining_server(config, engine, s.drain_timeout, closing)
    died: list[BaseException] = []

    def on_death(exc: BaseException) -> None:
        # the engine has answered every in-flight request with an error; new ones get 503
        log.critical("engine died (%s: %s): stopping the server, exit code 1", type(exc).__name__, exc)
        died.append(exc)
        server.should_exit = True

    engine.on_death = on_death
    if engine.error is not None:      # died before the callback was set
        on_death(engine.error)
    server.run(sockets=sockets)
    engine.shutdown(timeout=FLUSH_SECONDS / 2)   # after the drain: within its budget
    if died:
        log.critical("exiting 1: the engine died (%s)", died[0])
        return 1
    log.info("stopped")
    return 0


def keep_torch_out() -> None:
    """Serving needs no torch, but transformers imports it whenever it is installed (a dev venv
    has it for the tests), and torch's backend autoload then imports spyre_torch. A None in
    sys.modules makes `torch` unfindable (importlib.util.find_spec returns None), so transformers
    runs its tokenizers without it: the serving process is the Docker image's, torch or not."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    keep_torch_out()
    from spyre_serve.device.process import configure

    configure()     # threads, ISA level, compile cache: before any kernel is imported
    command, s = parse_command(argv)
    if command == "warmup":
        return warmup(s)
    if command == "plan":
        from spyre_serve.server.launch.plan import plan

        return plan(s)
    code = serve(s)
    if code:
        # a dead engine may leave a thread stuck in a kernel: exit without waiting for it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
