"""Rich presentation layer: live neuron dashboard, plain line logs, status/summary views, progress.

It only *reads* telemetry snapshots and plain dicts. Keep imports light: rich, the stdlib and
``dtrain.telemetry`` only; never torch, hivemind, transformers, datasets or bittensor, because
the CLI loads these modules for ``--help`` and shell completion.
"""
