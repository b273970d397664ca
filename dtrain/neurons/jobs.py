"""Run work on the training thread on behalf of API handler threads.

The model, its gradients and the optimizer belong to one thread. Validator
queries arrive on the HTTP server's worker threads; they hand their work here
and wait for the answer, so no two threads ever touch the model at once.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any, Callable


class JobQueue:
    def __init__(self) -> None:
        self._jobs: "queue.Queue[tuple[Callable[[], Any], Future]]" = queue.Queue()
        self._closed: BaseException | None = None

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._closed is not None:
            # Shutting down: answer at once instead of leaving a handler thread waiting.
            future.set_exception(self._closed)
            return future
        self._jobs.put((fn, future))
        return future

    def run_pending(self, wait_s: float = 0.0) -> int:
        """Run queued jobs on the calling (training) thread; wait up to ``wait_s`` for the first."""
        ran = 0
        try:
            fn, future = self._jobs.get(timeout=wait_s) if wait_s > 0 else self._jobs.get_nowait()
        except queue.Empty:
            return 0
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the waiting handler thread
                    future.set_exception(exc)
            ran += 1
            try:
                fn, future = self._jobs.get_nowait()
            except queue.Empty:
                return ran

    def close(self, reason: BaseException) -> None:
        """Refuse new jobs and fail the queued ones with ``reason``."""
        self._closed = reason
        self.cancel_all(reason)

    def cancel_all(self, reason: BaseException) -> None:
        while True:
            try:
                _, future = self._jobs.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(reason)
