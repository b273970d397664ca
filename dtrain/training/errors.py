"""Exceptions of the training core.

Every error names what failed and what the operator can do about it. The core
never falls back silently: callers catch these and decide.
"""


class TrainingError(Exception):
    """Base class of every error raised by ``dtrain.training``.

    ``transient`` says whether trying again later can help (a timeout, a refused
    connection, an HTTP 5xx or 429) or not (no such dataset, model or file): a neuron
    retries the first kind with backoff and stops on the second.
    """

    def __init__(self, message: str = "", *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class ModelLoadError(TrainingError):
    """A model preset is unknown or a Hub model could not be loaded."""


class TokenizerLoadError(TrainingError):
    """The configured tokenizer could not be loaded and fallback was not allowed."""


class DataSourceError(TrainingError):
    """A dataset could not be opened or read (wrong name, unreachable Hub, missing files)."""


class CheckpointError(TrainingError):
    """A checkpoint is missing, corrupt, or does not match the model."""


class TrainerStateError(TrainingError):
    """The trainer was used out of order (e.g. step() with nothing accumulated)."""


# Words in exception class names of HTTP stacks (aiohttp, httpx, urllib3, fsspec) that
# mean "the network failed", for errors that do not derive from OSError.
_TRANSIENT_NAMES = ("timeout", "connect", "transport", "network", "disconnect", "remoteprotocol",
                    "incompleteread", "chunkedencoding", "readerror", "overloaded")
# HTTP statuses worth another try: request timeout, too early, too many requests.
_TRANSIENT_STATUS = (408, 425, 429)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (its own or its response's), if any."""
    for obj in (exc, getattr(exc, "response", None)):
        for attr in ("status_code", "status"):
            value = getattr(obj, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
    return None


def cause_chain(exc: BaseException, limit: int = 12) -> list[BaseException]:
    """``exc`` and what caused it, outermost first (``__cause__``, else ``__context__``):
    libraries wrap the network error that decides what to do in their own exceptions."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(out) < limit and all(current is not e for e in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failure that may go away by itself.

    Decided without importing any network library, over the chain of causes: an HTTP
    status anywhere in it wins (fsspec reports a 503 as FileNotFoundError *from* the
    response error), then the builtin OSError family, then class names. Anything
    unrecognised counts as permanent, so a misconfiguration fails fast instead of
    retrying for ever.
    """
    chain = cause_chain(exc)
    for e in chain:
        if isinstance(e, TrainingError):
            return e.transient  # decided where it was raised
        if "offlinemodeisenabled" in (c.__name__.lower() for c in type(e).__mro__):
            return False  # HF_HUB_OFFLINE is a setting, not an outage
    for e in chain:
        status = http_status(e)
        if status is not None:
            return status >= 500 or status in _TRANSIENT_STATUS
    for e in chain:
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(e, OSError):  # includes TimeoutError, ConnectionError, socket errors
            return True
        names = [c.__name__.lower() for c in type(e).__mro__]
        if any(word in name for name in names for word in _TRANSIENT_NAMES):
            return True
    return False


def describe_error(exc: BaseException) -> str:
    """``Type: message``, plus the HTTP status from the chain of causes when the message
    hides it (fsspec reports a 503 as ``FileNotFoundError: <url>``)."""
    text = f"{type(exc).__name__}: {exc}"
    for e in cause_chain(exc):
        status = http_status(e)
        if status is not None:
            return text if str(status) in text else f"{text} (HTTP {status})"
    return text

