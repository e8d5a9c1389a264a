"""``--api-server-count N``: N API processes serving HTTP on one port before one engine process
(vLLM's flag), so that the API's Python (reading and parsing bodies, tokenizing, templates,
SSE) has N event loops and N GILs.

    this process (the supervisor): binds the port, starts the engine process with N pipes
    (``engine_client.spawn_engine``), then N API processes (``api_process``), each with a pipe
    and the listening socket; the kernel hands each new connection to one of them.

A SIGTERM/SIGINT here is passed to every API process: each drains as ``serve`` does (its
requests finish or are cut with an error event at the deadline) and leaves the engine, which
exits once the last has left. The engine's death is seen by every API process (each exits 1);
an API process that exits non-zero makes the others stop, and this process exits 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time

from spyre_serve.server.launch import streams
from spyre_serve.server.launch.settings import Settings

log = logging.getLogger("spyre_serve")


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def serve_many(s: Settings) -> int:
    """Run the supervisor until every API process has exited: 0 after a drain, else 1."""
    from spyre_serve.models import resolve_model
    from spyre_serve.server.engine.client import spawn_engine

    resolve_model(s.model)                    # an unknown model is refused before any process
    sock = listening_socket(s.host, s.port, min(s.limit_concurrency, 4096))
    conns, engine = spawn_engine(s, s.api_server_count)
    ctx = multiprocessing.get_context("spawn")
    apis = [ctx.Process(target=api_process, args=(s, conn, sock, k), name=f"spyre-api-{k}")
            for k, conn in enumerate(conns)]
    for p in apis:
        p.start()
    for conn in conns:
        conn.close()
    sock.close()

    def forward(sig, frame) -> None:
        for p in apis:
            if p.is_alive():
                os.kill(p.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    log.info("serving on http://%s:%d/v1 with %d API processes (pids %s) and the engine process (pid %d)",
             s.host, s.port, len(apis), ", ".join(str(p.pid) for p in apis), engine.pid)
    code = 0
    while any(p.is_alive() for p in apis):
        time.sleep(0.2)
        failed = [p for p in apis if p.exitcode not in (None, 0)]
        if failed and not code:
            code = 2 if failed[0].exitcode == 2 else 1      # 2: the engine refused the model or a flag
            if code == 1:
                log.critical("API process %s exited %s: stopping the others", failed[0].name, failed[0].exitcode)
            forward(signal.SIGTERM, None)
    engine.join(30)
    if engine.is_alive():
        engine.kill()
    if engine.exitcode not in (0, None) and code != 2:
        code = 1
    log.info("stopped (exit code %d)", code)
    return code


def api_process(s: Settings, conn, sock: socket.socket, k: int) -> None:
    """One API process: the app over a client of the engine process (on ``conn``), served on
    the shared ``sock`` until its drain ends or the engine dies."""
    from spyre_serve.server.launch.cli import keep_torch_out

    keep_torch_out()
    os.setsid()      # a terminal's Ctrl-C reaches the supervisor alone, which passes it on once
    streams.install()
    logging.basicConfig(level=s.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api {k}]: %(message)s")
    from spyre_serve.server.engine.process import is_refusal
    from spyre_serve.server.launch.cli import build, refused_at_start, run

    try:
        built = build(s, conn=conn)
    except Exception as exc:
        if not is_refusal(exc):           # a refusal: the engine process's StartRefused, or this one's
            raise
        if k == 0:              # every API process is told; the first says it, in one line
            refused_at_start(exc)
        logging.shutdown()
        os._exit(2)
    code = run(built.app, built.engine, s, sockets=[sock])
    logging.shutdown()
    os._exit(code)
