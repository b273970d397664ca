"""Thread pools that start every worker up front.

``ThreadPoolExecutor`` starts its threads lazily, one more each time requests overlap, so a
neuron's thread count climbs in steps for days before it reaches the pool's size. A count that
steps up now and then cannot be told from a slow leak (``benchmarks/soak.py`` judges threads
flat or not); a pool that is full from the start keeps it flat, and a real leak stands out.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

_START_TIMEOUT_S = 30.0


def full_thread_pool(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A ThreadPoolExecutor of ``workers`` threads, all of them already running."""
    workers = max(1, int(workers))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    # Each task blocks until all have started, so no task finds an idle thread to reuse and
    # the pool starts one thread per task.
    everyone = threading.Barrier(workers)
    started = [pool.submit(everyone.wait, _START_TIMEOUT_S) for _ in range(workers)]
    concurrent.futures.wait(started, timeout=_START_TIMEOUT_S + 1)
    return pool


def default_executor_size() -> int:
    """The size asyncio gives a loop's default executor (min(32, CPUs + 4))."""
    return min(32, (os.cpu_count() or 1) + 4)
