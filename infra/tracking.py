"""MLflow tracking through accelerate's tracker, with a store that does not move with the cwd.

The store is `MLFLOW_TRACKING_URI` when set, else `sqlite:///<repo>/mlflow.db`; with any sqlite
store, artifacts go to `mlruns/` beside the database. Only the main process talks to MLflow
(accelerate's trackers are main-process only). The run id is kept in every checkpoint so a
resumed job continues the same run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from infra.config import flatten

REPO = Path(__file__).resolve().parents[1]
DEFAULT_URI = f"sqlite:///{REPO / 'mlflow.db'}"


def tracking_uri() -> str:
    """The store every process of this job (and `make ui`) uses."""
    return os.environ.setdefault("MLFLOW_TRACKING_URI", DEFAULT_URI)


def artifact_dir(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside a sqlite database, else the server's default."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///") :]).parent / "mlruns")
    return None


def run_name_for(config: dict[str, dict[str, Any]], args) -> str:
    """`args.run_name`, or one generated from the hyperparameters people compare runs by."""
    if args.run_name:
        return args.run_name
    t = config["TrainingArguments"]
    return f"lr{t['learning_rate']:g}-bs{t['per_device_train_batch_size']}x{t['gradient_accumulation_steps']}-s{t['seed']}"


def start_run(
    accelerator: Accelerator,
    experiment: str,
    run_name: str,
    config: dict[str, dict[str, Any]],
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> str | None:
    """Start (or, given `run_id`, continue) the MLflow run; returns its id on the main process.

    Parameters are logged once, when the run is created: MLflow refuses to change a parameter,
    and a resume may legitimately change one (a longer `max_steps`, say).
    """
    uri = tracking_uri()
    accelerator.init_trackers(
        experiment,
        config=None if run_id else flatten(config),
        init_kwargs={"mlflow": {"run_name": run_name, "run_id": run_id, "tags": tags, "logging_dir": artifact_dir(uri)}},
    )
    if not accelerator.is_main_process:
        return None
    return accelerator.get_tracker("mlflow", unwrap=True).info.run_id
