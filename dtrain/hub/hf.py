"""Hugging Face Hub model store (targets ``hf://owner/repo``).

Push = create the repo if missing, look the tag up (an existing tag is left alone: tags are
immutable), upload the folder as one commit on ``main``, tag that commit; each step retried
on its own. Credentials, endpoint and retries: docs/model-store.md, "Hugging Face Hub backend".
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any, Callable

from dtrain.hub.base import (
    ProgressCallback,
    ProgressEvent,
    PushResult,
    StoreAuthError,
    StoreError,
    StoreNotFoundError,
    emit,
    folder_files,
    log,
)
from dtrain.hub.retry import HUB_RETRY, RetryPolicy, call_with_retries, http_status, is_retryable
from dtrain.hub.tags import is_tag, newest, parse_tag

_TOKEN_HINT = "set HF_TOKEN or run `hf auth login` with a token that has write access"


def parse_hf_target(target: str) -> str:
    """'hf://owner/repo' -> 'owner/repo' (raises StoreError with the expected form)."""
    if not target.startswith("hf://"):
        raise StoreError(f"not a Hub target: {target!r} (expected hf://owner/repo)")
    repo_id = target[len("hf://") :].strip("/")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(c in repo_id for c in " \\:"):
        raise StoreError(f"invalid Hub target {target!r}: expected hf://owner/repo")
    return repo_id


# What huggingface_hub's upload_folder raises when the Hub's /api/validate-yaml refuses README.md.
_CARD_REJECTED = "Invalid metadata in README.md"


class HfStore:
    def __init__(
        self,
        repo_id: str,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        private: bool | None = None,
        retry: RetryPolicy = HUB_RETRY,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        from huggingface_hub import HfApi

        self.repo_id = repo_id
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        self.token = token
        self.private = private
        self.retry = retry
        self._sleep = sleep
        self._rng = rng
        self.api = HfApi(endpoint=self.endpoint, token=token)
        self.target = f"hf://{repo_id}"

    # ------------------------------------------------------------------ helpers

    def _translate(self, what: str) -> Callable[[BaseException], BaseException]:
        def translate(exc: BaseException) -> BaseException:
            code = http_status(exc)
            if code == 401:
                return StoreAuthError(
                    f"{what}: the Hub at {self.endpoint} rejected the credentials (HTTP 401); {_TOKEN_HINT}"
                )
            if code == 403:
                return StoreAuthError(
                    f"{what}: no permission on {self.repo_id} (HTTP 403); the token must be able to write "
                    f"to that namespace ({_TOKEN_HINT})"
                )
            if code == 404:
                return StoreNotFoundError(f"{what}: not found on {self.endpoint} (HTTP 404): {self.repo_id}")
            if code is not None:
                detail = getattr(exc, "server_message", None) or str(exc).splitlines()[0]
                return StoreError(f"{what}: Hub answered HTTP {code}: {detail}", retryable=is_retryable(exc))
            return StoreError(f"{what}: {type(exc).__name__}: {exc}", retryable=is_retryable(exc))

        return translate

    def _call(self, what: str, fn: Callable[[], Any], progress: ProgressCallback | None) -> tuple[Any, int]:
        return call_with_retries(
            fn,
            what=what,
            policy=self.retry,
            progress=progress,
            sleep=self._sleep,
            rng=self._rng,
            translate=self._translate(what),
        )

    # ------------------------------------------------------------------ ModelStore

    def push(self, folder: str | os.PathLike, tag: str, progress: ProgressCallback | None = None) -> PushResult:
        parse_tag(tag)
        src = Path(folder)
        total = sum(f.stat().st_size for f in folder_files(src))

        emit(progress, ProgressEvent("prepare", 0, total, message=f"create {self.repo_id} if missing"))
        _, attempts = self._call(
            f"create repo {self.repo_id}",
            lambda: self.api.create_repo(self.repo_id, repo_type="model", exist_ok=True, private=self.private),
            progress,
        )

        existing, n = self._call(f"list tags of {self.repo_id}", self._remote_tags, progress)
        attempts += n
        if tag in existing:
            emit(progress, ProgressEvent("done", total, total, message=f"{tag} already on the Hub"))
            return self._result(tag, existing[tag], attempts, total, already_existed=True)

        emit(progress, ProgressEvent("upload", 0, total, message=f"uploading {tag}"))
        revision, n = self._upload(src, tag, progress)
        attempts += n
        emit(progress, ProgressEvent("upload", total, total, message=f"uploaded {tag}"))

        emit(progress, ProgressEvent("tag", total, total, message=tag))
        _, n = self._call(
            f"tag {tag} on {self.repo_id}",
            lambda: self.api.create_tag(
                self.repo_id, tag=tag, revision=revision, repo_type="model", exist_ok=True
            ),
            progress,
        )
        attempts += n
        emit(progress, ProgressEvent("done", total, total, message=tag))
        return self._result(tag, revision, attempts, total)

    def _upload(self, src: Path, tag: str, progress: ProgressCallback | None) -> tuple[str, int]:
        """Upload ``src`` as one commit on ``main``; returns (commit id, attempts)."""

        def upload(ignore: list[str] | None = None) -> Any:
            return self.api.upload_folder(
                folder_path=str(src),
                repo_id=self.repo_id,
                repo_type="model",
                commit_message=f"dtrain checkpoint {tag}",
                ignore_patterns=ignore,
            )

        attempts = 0
        try:
            info, n = self._call(f"upload {tag} to {self.repo_id}", upload, progress)
        except StoreError as exc:
            # huggingface_hub asks the Hub to validate README.md's metadata before uploading;
            # a card the Hub rejects must not stop the weights from reaching peers every round.
            if _CARD_REJECTED not in str(exc):
                raise
            attempts += exc.attempts
            log.warning("the Hub rejected the model card of %s (%s); pushing it without README.md", tag, exc)
            info, n = self._call(f"upload {tag} to {self.repo_id}", lambda: upload(["README.md"]), progress)
        return getattr(info, "oid", None) or str(info), attempts + n

    def _result(self, tag: str, revision: str, attempts: int, total: int, *,
                already_existed: bool = False) -> PushResult:
        return PushResult(
            target=self.target,
            tag=tag,
            revision=revision,
            url=f"{self.endpoint}/{self.repo_id}/tree/{tag}",
            attempts=attempts,
            already_existed=already_existed,
            bytes_total=total,
        )

    def _remote_tags(self) -> dict[str, str]:
        """tag name -> commit id; {} when the repo does not exist yet."""
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            refs = self.api.list_repo_refs(self.repo_id, repo_type="model")
        except RepositoryNotFoundError as e:
            # huggingface_hub also maps some 401s to this class; only a real 404 means "no repo yet".
            if http_status(e) == 404:
                return {}
            raise
        return {t.name: t.target_commit for t in refs.tags}

    def list_tags(self) -> list[str]:
        tags, _ = self._call(f"list tags of {self.repo_id}", self._remote_tags, None)
        good = [t for t in tags if is_tag(t)]
        return sorted(good, key=lambda t: (parse_tag(t).run_id, parse_tag(t).epoch, parse_tag(t).inner_step))

    def latest(self, run_id: str | None = None) -> str | None:
        """Newest scheme tag (by epoch, then inner step); the Hub has no 'latest' pointer."""
        return newest(self.list_tags(), run_id)

    def fetch(self, tag: str, dest: str | os.PathLike, progress: ProgressCallback | None = None) -> Path:
        from huggingface_hub import snapshot_download

        parse_tag(tag)
        out = Path(dest)
        emit(progress, ProgressEvent("download", message=f"{self.repo_id}@{tag}"))
        path, _ = self._call(
            f"download {self.repo_id}@{tag}",
            lambda: snapshot_download(
                repo_id=self.repo_id,
                revision=tag,
                local_dir=str(out),
                endpoint=self.endpoint,
                token=self.token,
            ),
            progress,
        )
        emit(progress, ProgressEvent("done", message=tag))
        return Path(path)
