"""The averager's forked process may run torch ops in several threads at once from its start,
and runs them with the averager's own torch thread count (AVERAGER_TORCH_THREADS).

hivemind forks the averager. When the parent has called ``torch.set_num_threads`` (the test
suite does at collection, an operator's script may), each new thread's first torch op in the
child re-applies that count and rebuilds the thread pool torch marked as lost in the fork;
threads doing it together race and one fails with "Invalid thread pool!". In a round that was
the 8-bit codec's first part for one reducer, in hivemind's writer task: the reducer heard
nothing and banned an honest sender (dtrain/swarm/hivemind_internals/averager.py, reset_torch_threads_after_fork).

The check runs in a fresh interpreter so the torch state it sets up is exactly the one above.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILDREN = 20  # without the reset about 6 in 10 children fail: 20 clean ones are no accident

SCRIPT = textwrap.dedent(
    f"""
    import os, sys, threading
    import torch
    from hivemind.compression import CompressionInfo
    from dtrain.swarm.hivemind_internals import AVERAGER_TORCH_THREADS, reset_torch_threads_after_fork
    from dtrain.swarm.wire import make_compression

    torch.set_num_threads(2)
    (torch.randn(1_000_000) * 2).sum()  # the parent has used its pool before it forks
    codec = make_compression("8bit")
    reset = sys.argv[1] == "reset"

    def child():
        if reset:
            reset_torch_threads_after_fork()  # what the averager process does first
            if torch.get_num_threads() != AVERAGER_TORCH_THREADS:
                print("threads", torch.get_num_threads(), flush=True)
                os._exit(1)
        errors = []
        start = threading.Barrier(8)

        def compress_a_part():
            start.wait()  # the senders' first parts, all at once
            part = torch.randn(3855)
            try:
                codec.compress(part, CompressionInfo.from_tensor(part))
            except Exception as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=compress_a_part) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            print(errors[0], flush=True)
        os._exit(1 if errors else 0)

    failed = 0
    for _ in range({CHILDREN}):
        pid = os.fork()
        if pid == 0:
            child()
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    print("FAILED", failed)
    """
)


def _failed_children(mode: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    return int(last.split()[1]), proc.stdout


def test_a_forked_averager_runs_the_codec_in_parallel_threads_after_the_reset():
    failed, out = _failed_children("reset")
    assert failed == 0, out[-2000:]
