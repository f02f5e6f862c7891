"""``kvgate serve --config kvgate.yaml [--host H --port P] [--workers N]``: run the gateway with uvicorn.

``--workers N`` runs N gateway processes on one port: each binds its own listening socket with
``SO_REUSEPORT``, so the kernel spreads connections evenly over them (with one shared socket, as uvicorn's
own ``--workers`` does, an idle-ish process tends to win every accept). A dead process is restarted.
Each process builds its own gateway from the same configuration: with the in-memory index
each subscribes to the same KV event streams and keeps an identical index of its own (no Redis needed on
one machine); with Redis they share it. Responses API owners are per process in memory too: a process
that has no record of a response asks the workers who holds it (router/apis/routes.py ``_locate``).
Admin changes made at run time (workers added, the policy) and
``/metrics`` are per process, so with N > 1 configure workers in the file or through discovery.
"""
from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML configuration file (else $KVGATE_CONFIG; env KVGATE_* overrides)")
    p.add_argument("--host", help="listen address (default: settings.host)")
    p.add_argument("--port", type=int, help="listen port (default: settings.port)")
    p.add_argument("--log-level", help="uvicorn log level (default: settings.log_level)")
    p.add_argument("--workers", type=int, default=int(os.environ.get("KVGATE_SERVE_WORKERS", "1")),
                   help="gateway processes on one port (default 1; 0 = one per CPU core)")


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def app_factory():
    """The app of one gateway process (``--workers``: uvicorn calls this in each)."""
    from router.app import create_app
    from router.config import load_settings

    settings = load_settings()
    _logging(settings.log_level)
    return create_app(settings, serving=True)


def _serve_process(host: str, port: int, common: dict) -> None:
    """One gateway process on its own SO_REUSEPORT socket (the target of each ``--workers`` child)."""
    import socket

    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    uvicorn.Server(uvicorn.Config(app_factory(), **common)).run(sockets=[sock])


def _supervise(n: int, host: str, port: int, common: dict) -> int:
    """Start ``n`` gateway processes, restart any that dies, stop them all on SIGTERM/SIGINT."""
    import logging
    import multiprocessing as mp
    import signal
    import time

    log = logging.getLogger("kvgate.serve")
    ctx = mp.get_context("spawn")
    stopping = False

    def start():
        p = ctx.Process(target=_serve_process, args=(host, port, common), daemon=False)
        p.start()
        return p

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    children = [start() for _ in range(n)]
    log.info("kvgate: %d gateway processes on %s:%d", n, host, port)
    restarts = 0
    while not stopping:
        time.sleep(0.5)
        for i, p in enumerate(children):
            if not p.is_alive() and not stopping:
                restarts += 1
                log.warning("gateway process %d exited (%s); restarting", p.pid, p.exitcode)
                if restarts > 10 * n:
                    log.error("gateway processes keep exiting; giving up")
                    stopping = True
                    break
                children[i] = start()
    for p in children:
        if p.is_alive():
            p.terminate()  # SIGTERM: uvicorn drains (timeout_graceful_shutdown) and exits
    deadline = time.monotonic() + common.get("timeout_graceful_shutdown", 30) + 5
    for p in children:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    return 0 if restarts <= 10 * n else 1


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from router.app import create_app
    from router.config import load_settings

    try:
        settings = load_settings(args.config)  # also exports $KVGATE_CONFIG for worker processes
    except (ValidationError, ValueError, OSError) as e:
        print(f"kvgate serve: invalid configuration: {e}")
        return 2
    level = args.log_level or settings.log_level
    _logging(level)
    workers = args.workers if args.workers > 0 else (os.cpu_count() or 1)
    host, port = args.host or settings.host, args.port or settings.port
    common = dict(log_level=level, access_log=False, timeout_graceful_shutdown=30)
    if workers == 1:
        uvicorn.run(create_app(settings, serving=True), host=host, port=port, **common)
        return 0
    return _supervise(workers, host, port, common)
