"""Turn a configured target string into a ModelStore."""

from __future__ import annotations

from typing import Any

from dtrain.hub.base import ModelStore
from dtrain.hub.local import LocalStore


def open_store(target: str, **hf_options: Any) -> ModelStore:
    """``hf://owner/repo`` -> HfStore; ``file://...`` or a plain path -> LocalStore.

    ``hf_options`` (endpoint, token, private, retry, ...) go to HfStore only.
    """
    if not isinstance(target, str) or not target.strip():
        raise ValueError("model store target is empty: expected hf://owner/repo, file:///path or a directory")
    target = target.strip()
    if target.startswith("hf://"):
        from dtrain.hub.hf import HfStore, parse_hf_target

        return HfStore(parse_hf_target(target), **hf_options)
    if "://" in target and not target.startswith("file://"):
        scheme = target.split("://", 1)[0]
        raise ValueError(f"unsupported model store target {target!r} (scheme {scheme}://): use hf:// or file://")
    return LocalStore(target)
