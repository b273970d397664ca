"""Where training text comes from (``DataSource``): its files in shard order, and its ``datasets`` stream.

Failures become DataSourceErrors that say what to fix and whether retrying can help
(docs/training.md, "Data"). ``datasets`` is imported only when a source is opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from dtrain.training.errors import DataSourceError, describe_error, is_transient

FINEWEB = "HuggingFaceFW/fineweb"
FINEWEB_CONFIG = "sample-350BT"


@dataclass(frozen=True)
class DataSource:
    """Where the text comes from. ``path`` is a Hub dataset id or a builder name."""

    path: str = FINEWEB
    name: str | None = FINEWEB_CONFIG
    data_files: tuple[str, ...] | None = None
    split: str = "train"
    text_field: str = "text"
    revision: str | None = None

    @classmethod
    def fineweb(cls, config: str = FINEWEB_CONFIG, revision: str | None = None) -> "DataSource":
        return cls(path=FINEWEB, name=config, revision=revision)

    @classmethod
    def local_text(cls, files: Sequence[str]) -> "DataSource":
        """Plain text files, one document per line. File order defines shard order."""
        return cls(path="text", name=None, data_files=tuple(str(f) for f in files))

    @classmethod
    def local_parquet(cls, files: Sequence[str], text_field: str = "text") -> "DataSource":
        """Parquet files (paths or fsspec URLs), one document per row. File order defines shard order."""
        return cls(path="parquet", name=None, data_files=tuple(str(f) for f in files), text_field=text_field)

    @property
    def is_parquet_files(self) -> bool:
        """Explicit data files that are all parquet (read by row group)."""
        return bool(self.data_files) and (self.path == "parquet" or all(
            f.lower().split("?")[0].endswith(".parquet") for f in self.data_files))

    def identity(self) -> list:
        """What tells local data apart cheaply: each file's name and size, in shard order.

        Local files have no revision to pin; two peers with other files (or the same names
        with other sizes) build other pages, and this makes their swarm fingerprints differ.
        Remote files and globs are named only (a revision pins those).
        """
        out: list = []
        for f in self.data_files or ():
            try:
                out.append([os.path.basename(f), os.path.getsize(f)])
            except OSError:
                out.append([f, None])
        return out

    @classmethod
    def shipped(cls) -> "DataSource":
        from dtrain.training.assets import shipped_corpus_files

        return cls.local_text(shipped_corpus_files())

    def describe(self) -> str:
        if self.data_files is not None:
            return f"{self.path} builder on {len(self.data_files)} file(s)"
        return (f"{self.path}" + (f" ({self.name})" if self.name else "")
                + (f" at revision {self.revision}" if self.revision else ""))




def _check_local_files(source: DataSource) -> None:
    if source.data_files is None:
        return
    missing = [f for f in source.data_files
               if "://" not in f and not any(c in f for c in "*?[") and not os.path.exists(f)]
    if missing:
        raise DataSourceError(
            f"data file(s) not found: {', '.join(missing[:5])}; check the data_files setting"
        )


def _hub_offline() -> bool:
    # HF_HUB_OFFLINE or datasets' own HF_DATASETS_OFFLINE is a setting to change, not an
    # outage: waiting never brings the Hub back.
    from dtrain.training.hub_access import offline_mode

    return offline_mode() or os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_dataset_problem(source: DataSource, exc: BaseException) -> str:
    """What went wrong opening a Hub dataset, and the fix, in an operator's terms.

    Unlike a tokenizer, a dataset like FineWeb is far too large to download whole, so the
    offline answer is a few parquet shards used as a local source, never "download it".
    """
    from dtrain.training.hub_access import NO_SUCH_REPO, NO_SUCH_REVISION, classify, endpoint, explain

    head = f"could not open the dataset data.dataset = {source.path!r}" + (
        f" (config {source.name!r})" if source.name else "") + (
        f" at data.dataset_revision = {source.revision!r}" if source.revision else "")
    shards = (f"`hf download {source.path} --repo-type dataset --include '<a few .parquet files>'`"
              + (f" --revision {source.revision}" if source.revision else ""))
    local = (f'download a few of its parquet shards ({shards}) and set data.source = "local" with '
             "data.local_path pointing at them")
    detail = describe_error(exc)
    if _hub_offline():
        return (f"{head}: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set, and streaming a Hub dataset needs the "
                f"Hub. Unset it, or {local}. ({detail})")
    if classify(exc) in (NO_SUCH_REPO, NO_SUCH_REVISION):
        # worded like a missing tokenizer or model: no download advice applies to these
        return explain("dataset", source.path, exc, revision=source.revision or None, repo_type="dataset",
                       key="data.dataset", revision_key="data.dataset_revision") + f" ({detail})"
    return (f"{head}: {detail}. Check data.dataset, data.dataset_config and data.dataset_revision and that the "
            f"Hub ({endpoint()}) is reachable (network, proxy, or HF_ENDPOINT for a mirror); or {local}.")


def resolve_data_files(source: DataSource) -> list[str]:
    """The files of ``source``'s split, in shard order.

    Explicit ``data_files`` are returned as given. For a Hub dataset the ``datasets``
    builder lists them at ``source.revision`` (``hf://datasets/<id>@<commit>/...``), the
    list ``load_dataset(..., streaming=True)`` would shard.
    """
    _check_local_files(source)
    if source.data_files is not None:
        return list(source.data_files)
    import datasets

    try:
        builder = datasets.load_dataset_builder(source.path, source.name, revision=source.revision or None)
        files = builder.config.data_files
    except Exception as exc:
        raise DataSourceError(_hub_dataset_problem(source, exc),
                              transient=is_transient(exc) and not _hub_offline()) from exc
    if not files or source.split not in files:
        raise DataSourceError(f"dataset {source.describe()} has no data files for split {source.split!r}"
                              + (f" (splits: {sorted(files)})" if files else ""))
    return [str(f) for f in files[source.split]]


def open_stream(source: DataSource):
    """``datasets.load_dataset(..., streaming=True)`` for ``source``; clear errors on failure."""
    import datasets

    _check_local_files(source)
    try:
        ds = datasets.load_dataset(
            source.path,
            source.name,
            data_files=list(source.data_files) if source.data_files is not None else None,
            split=source.split,
            streaming=True,
            revision=source.revision or None,
        )
    except Exception as exc:
        if source.data_files is None:
            raise DataSourceError(_hub_dataset_problem(source, exc),
                                  transient=is_transient(exc) and not _hub_offline()) from exc
        raise DataSourceError(
            f"could not open dataset {source.describe()} split {source.split!r}: "
            f"{describe_error(exc)}. Check the data files.",
            transient=is_transient(exc) and not _hub_offline(),
        ) from exc
    return ds
