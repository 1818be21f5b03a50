"""A real uvicorn server for an app, on a free 127.0.0.1 port, in a thread of the test process."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def running(app):
    """Start `app`, yield its port, stop it on exit."""
    sock = free_socket()
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(10)
