"""Miner HTTP API: an aiohttp server with btauth/1 hotkey-signed requests, and
the validator-side client.

Kept import-free so ``dtrain --help`` stays fast; import the submodules:
``dtrain.api.server`` (``MinerApiServer``, ``Handlers``), ``dtrain.api.client``
(``MinerClient``), ``dtrain.api.messages`` (request/response payloads), built on
``dtrain.api.message_base`` and ``dtrain.api.rules`` (their validation), and
``dtrain.api.openapi`` (the OpenAPI document).
"""
