"""Suite-wide hooks.

A quiet end of a pytest-xdist run: when the controller closes a worker's gateway, execnet waits 5 s for the
worker's session to finish and then sends the worker a SIGINT (``execnet.gateway_base._terminate_execution``).
A worker whose teardown is slower than that (freeing TVM modules, torch, process pools; GC running all along)
takes the KeyboardInterrupt wherever it is, often inside hypothesis's GC-timing callback, where Python can
only print it: a ``KeyboardInterrupt`` traceback after ``[100%]`` of a run that passed.  Every test has
reported by then, so a worker ignores SIGINT from its session's end on; execnet still ends a worker that
has not finished 10 s later (``os._exit``), and the controller still takes the user's Ctrl-C.
"""

from __future__ import annotations

import signal
import threading

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reports the worker finished (and the gateway closes)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after a test (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``):
    a compile of an earlier test (its guards, its recompile counts, automatic dynamic shapes) must not decide
    what the next test's compile sees.  torch is imported here, not at the top, so tests without it start fast."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
