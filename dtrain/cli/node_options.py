"""The options every long-running neuron command takes, declared once.

``dtrain mine`` and ``dtrain validate`` both read a config, talk to a chain with a wallet,
keep state in a data directory, train on a device and log the same way. ``@node_command`` adds those
options to a command and hands the command one :class:`NodeOptions`, whose
``overrides()`` maps them onto config keys; each command declares only its own options.

Typer builds the CLI from the function signature, so the decorator publishes a merged
signature (the shared options first, then the command's own).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from dtrain.cli.common import (
    AnnounceMaddrOpt, ConfigOpt, DataDirOpt, DeviceOpt, HostMaddrOpt, HotkeyOpt, LogFormatOpt, NetuidOpt, NetworkOpt,
    NoDashboardOpt, SandboxDirOpt, WalletOpt, WalletPathOpt, address_overrides, chain_overrides,
)


@dataclass(frozen=True)
class NodeOptions:
    config: Path | None = None
    network: str | None = None
    netuid: int | None = None
    wallet: str | None = None
    wallet_hotkey: str | None = None
    wallet_path: str | None = None
    sandbox_dir: Path | None = None
    data_dir: Path | None = None
    device: str | None = None
    no_dashboard: bool = False
    log_format: str | None = None
    # Both roles join all-reduce rounds, so both must be dialable (dtrain.swarm.reachability).
    announce_maddr: list[str] | None = None
    host_maddr: list[str] | None = None

    def overrides(self) -> dict[str, Any]:
        """Config keys set by these flags (None: flag not given, the config decides)."""
        return {
            **chain_overrides(self.network, self.netuid, self.wallet, self.wallet_hotkey, self.wallet_path,
                              self.sandbox_dir),
            "node.data_dir": str(self.data_dir) if self.data_dir else None,
            "node.log_format": self.log_format,
            "training.device": self.device,
            **{k: v for k, v in address_overrides(None, self.announce_maddr, self.host_maddr).items()
               if k != "api.external_address"},
        }


# Annotation of each shared option, in the order --help lists them.
_ANNOTATIONS = {
    "config": ConfigOpt, "network": NetworkOpt, "netuid": NetuidOpt, "wallet": WalletOpt,
    "wallet_hotkey": HotkeyOpt, "wallet_path": WalletPathOpt, "sandbox_dir": SandboxDirOpt,
    "data_dir": DataDirOpt, "device": DeviceOpt, "no_dashboard": NoDashboardOpt, "log_format": LogFormatOpt,
    "announce_maddr": AnnounceMaddrOpt, "host_maddr": HostMaddrOpt,
}
assert list(_ANNOTATIONS) == [f.name for f in fields(NodeOptions)]


def node_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn(node: NodeOptions, **own_options)`` the shared options as real CLI options."""
    own = inspect.signature(fn, eval_str=True)
    if "node" not in own.parameters:
        raise TypeError(f"{fn.__name__} must take a 'node: NodeOptions' parameter")
    defaults = {f.name: f.default for f in fields(NodeOptions)}
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=annotation)
              for name, annotation in _ANNOTATIONS.items()]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in own.parameters.items() if name != "node"]
    clash = {p.name for p in rest} & set(_ANNOTATIONS)
    if clash:
        raise TypeError(f"{fn.__name__} redeclares shared node options: {sorted(clash)}")

    @functools.wraps(fn, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    def command(**kwargs: Any) -> Any:
        node = NodeOptions(**{name: kwargs.pop(name) for name in _ANNOTATIONS})
        return fn(node=node, **kwargs)

    params = shared + rest
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
