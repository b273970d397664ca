"""Why a Hugging Face Hub download failed, in words an operator can act on.

transformers and datasets wrap the Hub client's errors in an OSError that always suggests the
same things; the cause chain keeps the real reason (not cached while offline, Hub unreachable,
no such repository or revision, a repo without the file), and each has its own fix
(docs/training.md, "Tokenizer"). Only the standard library is imported at module level: the
CLI's ``--help`` may import this module through dtrain.training.tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.training.errors import cause_chain, http_status

# kinds returned by classify()
OFFLINE_MISSING = "offline-missing"
UNREACHABLE = "unreachable"
NO_SUCH_REPO = "no-such-repo"
NO_SUCH_REVISION = "no-such-revision"
NO_SUCH_FILE = "no-such-file"
LOCAL_PATH_MISSING = "local-path-missing"
OTHER = "other"

_TRUE = ("1", "true", "yes", "on")


def offline_mode() -> bool:
    """Whether HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) is set *now*.

    huggingface_hub reads the variable once at import; reading it at call time lets a
    caller pass ``local_files_only`` and skip the client's ~45 s of retries against an
    unreachable Hub even when the variable was set after the import.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - a dependency of transformers
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def cache_dir() -> str:
    """The Hub cache directory downloads go to (HF_HUB_CACHE, else $HF_HOME/hub)."""
    env = os.environ.get("HF_HUB_CACHE")
    if env:
        return env
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover
        return str(Path("~/.cache/huggingface/hub").expanduser())


def endpoint() -> str:
    env = os.environ.get("HF_ENDPOINT")
    if env:
        return env.rstrip("/")
    try:
        from huggingface_hub import constants

        return str(constants.ENDPOINT).rstrip("/")
    except ImportError:  # pragma: no cover
        return "https://huggingface.co"


def looks_like_path(name: str) -> bool:
    """A local directory rather than a Hub id (ids are ``name`` or ``owner/name``)."""
    return name.startswith(("/", "./", "../", "~")) or os.path.isabs(name) or name.count("/") > 1 \
        or os.path.exists(name)


def _names(e: BaseException) -> list[str]:
    return [c.__name__ for c in type(e).__mro__]


def classify(exc: BaseException, *, offline: bool = False) -> str:
    """One of the kinds above for a failed ``from_pretrained``/download.

    Decided on the Hub client's exception classes anywhere in the cause chain (by class
    name, so that a missing or renamed class never breaks error reporting), most specific
    first: a 404 naming the repo or revision beats the generic "not in the local cache"
    that transformers reports for every failure.
    """
    chain = cause_chain(exc)
    names = [n for e in chain for n in _names(e)]
    if "RevisionNotFoundError" in names:
        return NO_SUCH_REVISION
    if "RepositoryNotFoundError" in names or "GatedRepoError" in names:
        return NO_SUCH_REPO
    # LocalEntryNotFoundError derives from EntryNotFoundError but means "not cached", below
    if "RemoteEntryNotFoundError" in names or ("EntryNotFoundError" in names
                                               and "LocalEntryNotFoundError" not in names):
        return NO_SUCH_FILE
    for e in chain:
        status = http_status(e)
        if status is not None and (status >= 500 or status in (408, 429)):
            return UNREACHABLE
        if isinstance(e, (ConnectionError, TimeoutError)) or any(
                word in n.lower() for n in _names(e) for word in ("connecterror", "connectionerror", "timeout",
                                                                  "networkerror", "transporterror")):
            return UNREACHABLE
    if "OfflineModeIsEnabled" in names or "LocalEntryNotFoundError" in names:
        # Raised both for "offline and not cached" and "could not reach the Hub"; the
        # connection errors above were the second kind.
        return OFFLINE_MISSING if offline else UNREACHABLE
    return OTHER


def is_outage(exc: BaseException) -> bool:
    """Whether waiting can fix this load: the Hub could not be reached and nothing forbids
    trying it (HF_HUB_OFFLINE is a setting to change, not an outage to wait out)."""
    offline = offline_mode()
    return not offline and classify(exc, offline=offline) == UNREACHABLE


def download_command(repo_id: str, *, revision: str | None = None, repo_type: str = "model",
                     include: tuple[str, ...] = ()) -> str:
    parts = ["hf", "download", repo_id]
    if repo_type != "model":
        parts += ["--repo-type", repo_type]
    if revision:
        parts += ["--revision", revision]
    for pattern in include:
        parts += ["--include", f"'{pattern}'"]
    return " ".join(parts)


def explain(what: str, repo_id: str, exc: BaseException, *, revision: str | None = None,
            offline: bool | None = None, key: str | None = None, revision_key: str | None = None,
            repo_type: str = "model", include: tuple[str, ...] = ()) -> str:
    """A one-paragraph error message: what could not be loaded, why, and how to get it.

    ``what`` is "tokenizer", "model" or "dataset"; ``key``/``revision_key`` the config
    keys that name the id and revision (they appear in the message so the operator knows
    which line to fix); ``include`` the file patterns worth downloading (a tokenizer needs
    only the small JSON/text files of a model repo).
    """
    offline = offline_mode() if offline is None else offline
    where = f"{key} = {repo_id!r}" if key else repr(repo_id)
    at = f" at revision {revision!r}" if revision else ""
    head = f"could not load the {what} {where}{at}"
    cmd = download_command(repo_id, revision=revision, repo_type=repo_type, include=include)
    cache = cache_dir()
    reason = f"({type(exc).__name__}: {_first_line(exc)})"
    if looks_like_path(repo_id) and not Path(repo_id).expanduser().exists():
        return (f"{head}: the directory {repo_id} does not exist. Point {key or 'the setting'} at a directory "
                f"written by save_pretrained, or at a Hub id.")
    if looks_like_path(repo_id):
        return (f"{head}: {Path(repo_id).expanduser()} is not a usable {what} directory {reason}. It must hold "
                f"the files save_pretrained writes.")
    kind = classify(exc, offline=offline)
    if kind == OFFLINE_MISSING:
        if offline_mode():
            why, undo = "HF_HUB_OFFLINE is set", "or unset HF_HUB_OFFLINE to download it now"
        else:  # a caller passed local_files_only
            why, undo = "only local files were allowed", "or allow downloads"
        return (f"{head}: it is not in the local Hugging Face cache ({cache}) and {why}, so nothing is "
                f"downloaded. Download it once where the Hub is reachable: `{cmd}` (with the same HF_HOME, or "
                f"copy that cache directory here), {undo}.")
    if kind == UNREACHABLE:
        root = cause_chain(exc)[-1]  # the refused connection or HTTP 5xx, not transformers' wrapper
        reason = f"({type(root).__name__}: {_first_line(root)})"
        return (f"{head}: the Hugging Face Hub ({endpoint()}) could not be reached {reason} and it is not in the "
                f"local cache ({cache}). Check the network or proxy, or set HF_ENDPOINT to a mirror; or download "
                f"it ahead with `{cmd}`: a cached copy is used when the Hub cannot be reached (and HF_HUB_OFFLINE=1 "
                "skips the Hub's ~45 s of retries where nothing else needs it).")
    if kind == NO_SUCH_REPO:
        return (f"{head}: the Hub ({endpoint()}) has no {repo_type} repository {repo_id!r}. Check "
                f"{key or 'the id'} for a typo; a private or gated repository also needs a token "
                f"(`hf auth login` or HF_TOKEN).")
    if kind == NO_SUCH_REVISION:
        return (f"{head}: {repo_id!r} has no revision {revision!r}. Set {revision_key or 'the revision'} to a "
                f"branch, tag or commit of that repository (empty: its default branch).")
    if kind == NO_SUCH_FILE:
        return (f"{head}: {repo_id!r} exists but lacks the files a {what} needs {reason}. Check that "
                f"{key or 'the id'} names a {what} repository.")
    return (f"{head} {reason}. Check that {key or 'the id'} names a {what} (a Hub id or a local directory) "
            f"and the network (HF_ENDPOINT for a mirror), or download it ahead with `{cmd}`.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
