"""``dtrain push``: upload the local checkpoint to the model store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dtrain.cli.common import CommandError, ConfigOpt, DataDirOpt, JsonOpt, cli_errors, load, print_json


@cli_errors
def push(
    config: ConfigOpt = None,
    repo: Annotated[Optional[str], typer.Option("--repo", help="hf://owner/repo or a local directory store.")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(
        "--checkpoint", help="Checkpoint directory to upload (default: the newest under the data dir).")] = None,
    data_dir: DataDirOpt = None,
    retries: Annotated[Optional[int], typer.Option("--retries", help="Upload attempts before giving up.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Upload the latest checkpoint, tagged {run_id}.{epoch}.{inner_step}, with retries."""
    cfg = load(config, {"hub.repo": repo, "hub.push_retries": retries,
                        "node.data_dir": str(data_dir) if data_dir else None})
    import os
    import tempfile

    from dtrain.hub.base import StoreError
    from dtrain.hub.tags import TagError
    from dtrain.neurons.publish import export_checkpoint, find_checkpoint, open_configured_store
    from dtrain.neurons.runtime import NeuronError
    from dtrain.training.errors import TrainingError

    # Our own progress bar replaces huggingface_hub's.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        store = open_configured_store(cfg)
        source = find_checkpoint(cfg, checkpoint)
        with tempfile.TemporaryDirectory(prefix="dtrain-push-") as staging:
            tag = export_checkpoint(cfg, source, Path(staging))
            if json_out:
                result = store.push(staging, tag)
            else:
                from dtrain.ui.progress import push_progress

                with push_progress() as progress:
                    result = store.push(staging, tag, progress=progress)
    except (NeuronError, TrainingError, TagError) as exc:
        raise CommandError(str(exc)) from None
    except StoreError as exc:
        raise CommandError(f"push to {cfg.hub.repo} failed: {exc}") from None
    doc = {"target": result.target, "tag": result.tag, "revision": result.revision, "url": result.url,
           "attempts": result.attempts, "already_existed": result.already_existed, "bytes": result.bytes_total,
           "checkpoint": str(source)}
    if json_out:
        print_json(doc)
    else:
        typer.echo(f"pushed {source} to {result.url} as {result.tag} ({result.attempts} attempt(s))")
