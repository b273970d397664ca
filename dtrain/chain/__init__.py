"""Chain layer: the ``Chain`` protocol, a bittensor backend and an embedded sandbox.

Kept import-free on purpose: ``dtrain --help`` must not pay for (or require)
bittensor. Import from the submodules: ``dtrain.chain.base``,
``dtrain.chain.factory``, ``dtrain.chain.sandbox`` (with ``sandbox_db`` and
``sandbox_weights``), ``dtrain.chain.commitment``,
``dtrain.chain.retry``, ``dtrain.chain.bittensor_backend``.
"""
