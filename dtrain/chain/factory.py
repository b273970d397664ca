"""``open_chain``: pick the backend from the network name."""

from __future__ import annotations

import os
from typing import Any, Optional

from dtrain.chain.base import Chain, ChainError, UnknownNetwork

BITTENSOR_NETWORKS = ("finney", "test", "local")


def open_chain(
    network: str,
    netuid: int,
    *,
    wallet: Any = None,
    hotkey: Optional[str] = None,
    sandbox_dir: Optional[str | os.PathLike] = None,
    substrate: Any = None,
    **backend_options: Any,
) -> Chain:
    """Open a chain: ``sandbox`` → the embedded store in ``sandbox_dir``;
    ``finney``/``test``/``local``/``ws://…``/``wss://…`` → bittensor.

    ``wallet`` (a ``bittensor.Wallet``) signs commits and weights; for the
    sandbox a bare ``hotkey`` ss58 is enough. Raises :class:`ChainError`
    subclasses: ``UnknownNetwork``, ``SandboxMissing``.
    """
    if not isinstance(network, str) or not network.strip():
        raise UnknownNetwork("network is empty; use sandbox, finney, test, local or a ws:// URL")
    name = network.strip()
    if name == "sandbox":
        from dtrain.chain.sandbox import SandboxChain

        if sandbox_dir is None:
            raise ChainError("network 'sandbox' needs a sandbox directory (--sandbox-dir)")
        if hotkey is None and wallet is not None:
            hotkey = wallet.hotkey.ss58_address
        return SandboxChain(sandbox_dir, hotkey=hotkey, netuid=netuid, **backend_options)
    if name in BITTENSOR_NETWORKS or name.startswith(("ws://", "wss://")):
        if name.startswith(("ws://", "wss://")) and len(name.split("://", 1)[1]) == 0:
            raise UnknownNetwork(f"network URL {name!r} has no host")
        from dtrain.chain.bittensor_backend import BittensorChain

        return BittensorChain(name, netuid, wallet=wallet, substrate=substrate, **backend_options)
    raise UnknownNetwork(
        f"unknown network {name!r}: expected sandbox, finney, test, local, ws://host:port or wss://host:port"
    )
