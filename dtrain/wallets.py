"""Wallet lookups that need only the filesystem.

bittensor keeps a wallet as ``<path>/<name>/coldkeypub.txt`` plus
``<path>/<name>/hotkeys/<hotkey>``. Checking for those files is enough for
``dtrain init`` to warn early, without importing bittensor on a fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WalletCheck:
    wallet_dir: Path
    coldkey_exists: bool
    hotkey_exists: bool

    @property
    def ok(self) -> bool:
        return self.coldkey_exists and self.hotkey_exists


def check_wallet(path: str, name: str, hotkey: str) -> WalletCheck:
    wallet_dir = Path(path).expanduser() / name
    coldkey = (wallet_dir / "coldkeypub.txt").is_file() or (wallet_dir / "coldkey").is_file()
    return WalletCheck(wallet_dir, coldkey, (wallet_dir / "hotkeys" / hotkey).is_file())


def create_command(path: str, name: str, hotkey: str, *, coldkey_exists: bool) -> str:
    """The btcli line that creates what is missing (bittensor 11's btcli syntax)."""
    path_flag = "" if Path(path).expanduser() == Path("~/.bittensor/wallets").expanduser() else f" --wallet-path {path}"
    if coldkey_exists:
        return f"btcli wallet new-hotkey --wallet {name} --wallet-hotkey {hotkey}{path_flag}"
    return f"btcli wallet create --wallet {name} --wallet-hotkey {hotkey}{path_flag}"
