"""Run a long-lived neuron (miner or validator) with signals, dashboard or line logs.

Ctrl-C (SIGINT) or SIGTERM asks the neuron to stop: it finishes the step it is in,
saves a checkpoint, leaves the DHT and returns, and the command exits 0. A second
signal stops at once. A neuron started with a lifeline (dtrain/lifeline.py) stops the
same way when its supervisor dies.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any, Callable

from dtrain.cli.common import CommandError, err, require_swarm_library, use_dashboard
from dtrain.config import Config
from dtrain.telemetry import Telemetry


def run_neuron(cfg: Config, role: str, no_dashboard: bool,
               build: Callable[[Telemetry, threading.Event], Any]) -> int:
    """``build(telemetry, stop)`` returns the neuron; its ``run()`` returns the exit code."""

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    telemetry = Telemetry(role)
    stop = threading.Event()
    state = {"signals": 0}

    def on_signal(signum, frame):
        state["signals"] += 1
        if state["signals"] > 1:
            raise KeyboardInterrupt
        telemetry.event(f"{signal.Signals(signum).name} received: finishing the current step, then stopping")
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _hold_lifeline(telemetry, stop)
        neuron = build(telemetry, stop)
        if use_dashboard(cfg, no_dashboard):
            from dtrain.ui.dashboard import LiveDashboard

            with LiveDashboard(telemetry, refresh_hz=cfg.dashboard.refresh_hz):
                return _run(neuron)
        from dtrain.ui.loglines import attach_line_logger

        attach_line_logger(telemetry, sys.stderr, fmt=cfg.node.log_format, min_interval_s=10.0)
        return _run(neuron)
    except KeyboardInterrupt:
        err(f"dtrain {role}: interrupted twice; stopped without a final checkpoint")
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _hold_lifeline(telemetry: Telemetry, stop: threading.Event) -> None:
    """Stop when the supervisor that passed a lifeline dies (dtrain/lifeline.py)."""
    from dtrain.lifeline import lifeline_fd, watch_lifeline

    try:
        fd = lifeline_fd()
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if fd is None:
        return

    def lost() -> None:
        telemetry.event("the supervisor that started this neuron is gone: stopping")
        stop.set()

    watch_lifeline(fd, lost)


def _run(neuron) -> int:
    from dtrain.chain.base import ChainClientBug, ChainError
    from dtrain.hub.base import StoreError
    from dtrain.neurons.runtime import NeuronError
    from dtrain.training.errors import TrainingError
    from dtrain.validation.state import StateError

    try:
        require_swarm_library()  # first: an untested hivemind fails mid-round, not at import
        return neuron.run()
    except (NeuronError, TrainingError, ChainError, StateError, StoreError) as exc:
        raise CommandError(str(exc)) from None
    except ChainClientBug as exc:
        # A bug, not an outage: the traceback of the SDK's error is what a report needs.
        import traceback

        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
        raise CommandError(f"{exc} (the SDK's traceback is above)") from None
    except OSError as exc:
        # Typically a port already in use or a data directory that cannot be written.
        where = exc.filename or "check api.port, api.metrics_port and node.data_dir"
        raise CommandError(f"{exc.strerror or exc} ({where})") from None
