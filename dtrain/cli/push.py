"""``dtrain push``: upload the local checkpoint to the model store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dtrain.cli.common import ConfigOpt, DataDirOpt, JsonOpt, NotYetAvailable, cli_errors, load


@cli_errors
def push(
    config: ConfigOpt = None,
    repo: Annotated[Optional[str], typer.Option("--repo", help="hf://owner/repo or a local directory store.")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(
        "--checkpoint", help="Checkpoint to upload (default: the latest under the data dir).")] = None,
    data_dir: DataDirOpt = None,
    retries: Annotated[Optional[int], typer.Option("--retries", help="Upload attempts before giving up.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Upload the latest checkpoint, tagged {run_id}.{epoch}.{inner_step}, with retries."""
    cfg = load(config, {"hub.repo": repo, "hub.push_retries": retries,
                        "node.data_dir": str(data_dir) if data_dir else None})
    del cfg, checkpoint, json_out
    raise NotYetAvailable("push: the model store lands with issue #6.")
