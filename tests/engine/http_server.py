"""A server of `engine.serve` on a free 127.0.0.1 port in a thread, for the HTTP tests (tests/engine, tests/ctrl)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from engine.serve.app import make_app
from engine.serve.scheduler import Scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(sched: Scheduler, name: str = "tiny-moe") -> Iterator[str]:
    """uvicorn over `make_app(sched)`; yields the base URL and stops the server (draining) on exit."""
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(make_app(sched, name), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(30)
