"""Swarm layer: hivemind DHT identity/discovery, butterfly gradient averaging, round records.

Import the submodules you need (``dtrain.swarm.averaging``, ``dtrain.swarm.node``, ...);
this package file stays free of heavy imports so ``import dtrain.swarm`` is cheap.
"""
