"""hivemind's DHT process: a robust command pipe and a bounded start.

Imported only where a node starts, so ``dtrain --help`` never imports hivemind.
"""

from __future__ import annotations

from typing import Optional

import hivemind

from dtrain.swarm import startup
from dtrain.swarm.command_pipe import ServesCommandPipe


class DtrainDHT(ServesCommandPipe, hivemind.DHT):
    """A hivemind DHT that survives a request whose sender went away, and whose parent notices
    a child that died or hung before it was ready (dtrain/swarm/command_pipe.py, startup.py)."""

    def __init__(self, *args, start_timeout_s: float = startup.START_TIMEOUT_S, **kwargs):
        self._start_timeout_s = start_timeout_s  # read by run_in_background, which __init__ calls
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        startup.enable_stack_dumps()
        self._use_command_pipe()
        super().run()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        self.start()
        if await_ready:
            startup.await_ready(self, self.wait_until_ready, "DHT",
                                self._start_timeout_s if timeout is None else timeout)
