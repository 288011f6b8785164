"""Blocking calls of a trigger run where they cannot hold up the triggerer."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_daemon_thread(call: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``call`` in a daemon thread (one that never holds up the process's exit, unlike the
    event loop's executor); its future, which nothing can cancel."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(exc)

    future.set_running_or_notify_cancel()  # running: a cancelled waiter cannot cancel it
    threading.Thread(target=work, name=name, daemon=True).start()
    return future
