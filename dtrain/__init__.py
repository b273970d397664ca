"""dtrain: the miner and validator tool for Bittensor subnet 38 (Distributed Training).

Importing this package must stay cheap: the CLI's ``--help`` and shell completion
load it, and they must never pull in torch, hivemind, transformers, datasets or
bittensor. Heavy libraries are imported inside the functions that use them.
"""

__version__ = "0.1.0"
