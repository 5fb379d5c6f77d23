"""MLflow tracking through accelerate's tracker, with a store that does not move with the cwd.

The store is `MLFLOW_TRACKING_URI` when set, else `sqlite:///<repo>/mlflow.db`; with any sqlite
store, artifacts go to `mlruns/` beside the database. Only the main process talks to MLflow
(accelerate's trackers are main-process only). The run id is kept in every checkpoint so a
resumed job continues the same run; its status ends FINISHED, KILLED (preempted, interrupted) or
FAILED (an exception). Nothing that looks like a secret reaches the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.config import flatten, require
from infra.environment import REPO, environment_report, git_state, package_versions
from infra.files import atomic_write_text

DEFAULT_URI = f"sqlite:///{REPO / 'mlflow.db'}"


@dataclass
class TrackingConfig:
    """Tracking flags (part of TrainingArguments)."""

    _argument_group_name = "tracking (MLflow)"  # its heading in --help

    run_name: str | None = field(default=None, metadata={"help": "MLflow run name; generated from the main hyperparameters if unset."})
    experiment_name: str | None = field(default=None, metadata={"help": "MLflow experiment; the recipe's name if unset."})
    report_to: Literal["mlflow", "none"] = field(default="mlflow", metadata={"help": "Experiment tracker to log to."})
    log_model: bool = field(
        default=False,
        metadata={"help": "Log the exported model to the MLflow run as an MLflow transformers model (loadable with mlflow.pyfunc)."},
    )
    register_model: str | None = field(
        default=None, metadata={"help": "Also register the logged model in the MLflow model registry under this name (implies log_model)."}
    )

    def __post_init__(self):
        if self.register_model is not None:
            require(bool(re.fullmatch(r"[\w.\-/ ]{1,256}", self.register_model)), "register_model", self.register_model, "a model name")
            self.log_model = True


def tracking_uri() -> str:
    """The store every process of this job (and `make ui`) uses."""
    return os.environ.setdefault("MLFLOW_TRACKING_URI", DEFAULT_URI)


def artifact_dir(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside a sqlite database, else the server's default."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///") :]).parent / "mlruns")
    return None


def run_name_for(config: dict[str, dict[str, Any]], args, samples_per_step: int) -> str:
    """`args.run_name`, or the output_dir's name and the hyperparameters people compare runs by: `lr1e-3-lr0.001-b64-s42`
    (two runs of one experiment in other folders are told apart; `b`: the samples of a step, every process's)."""
    if args.run_name:
        return args.run_name
    t = config["TrainingArguments"]
    return f"{Path(t['output_dir']).name}-lr{t['learning_rate']:g}-b{samples_per_step}-s{t['seed']}"


def start_run(
    accelerator: Accelerator,
    experiment: str,
    run_name: str,
    config: dict[str, dict[str, Any]],
    output_dir: str | os.PathLike,
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
    restart: bool = True,
) -> str | None:
    """Start (or continue) the MLflow run; returns its id on the main process.

    The run continues `run_id` (from the checkpoint resumed), else, when `restart`, the run this
    output_dir last started (a job killed before its first checkpoint is still one run). Its id is
    kept in OUTPUT_DIR/mlflow_run_id. Parameters are logged once, when the run is created: MLflow
    refuses to change a parameter, and a resume may legitimately change one (a longer `max_steps`).
    """
    remembered = Path(output_dir) / "mlflow_run_id"
    if run_id is None and restart and remembered.is_file():
        run_id = remembered.read_text().strip() or None
    uri = tracking_uri()
    os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")  # CPU, memory, disk, GPU: MLflow's own sampler
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a dead server is noticed in seconds, not minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

    def init(uri: str, run_id: str | None) -> None:
        if accelerator.is_main_process:
            ensure_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment), uri)
        accelerator.init_trackers(
            experiment,
            config=None if run_id else safe_params(config),
            init_kwargs={"mlflow": {"run_name": run_name, "run_id": run_id, "tags": tags, "logging_dir": artifact_dir(uri)}},
        )

    created = run_id is None
    try:
        init(uri, run_id)
    except Exception as err:  # only the main process talks to MLflow, so only it can get here
        import mlflow

        accelerator.trackers = []
        try:
            if run_id is None:
                raise
            init(uri, None)  # the store is there but no longer has the run: start a new one
        except Exception:
            if uri == DEFAULT_URI:
                raise
            print(f"warning: tracking store {uri} unreachable ({type(err).__name__}); this run logs to {DEFAULT_URI}", flush=True)
            os.environ["MLFLOW_TRACKING_URI"] = DEFAULT_URI
            mlflow.set_tracking_uri(DEFAULT_URI)
            accelerator.trackers = []
            init(DEFAULT_URI, None)
        created = True
    if not accelerator.is_main_process:
        return None
    if created:
        log_run_artifacts(accelerator, config)
    started = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    remembered.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(remembered, started)
    return started


def ensure_experiment(name: str, uri: str) -> None:
    """The experiment `name` in the store, created if missing. accelerate's tracker looks it up and then creates it: of
    jobs (replica groups, say) starting together on a new store, one creates it and the others' creates fail, which
    would send their runs to the fallback store. Here the one that loses that race takes the winner's experiment."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(uri)
    if client.get_experiment_by_name(name) is not None:
        return
    try:
        client.create_experiment(name, artifact_location=artifact_dir(uri))
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def last_logged_step(run_id: str | None, key: str = "train/loss") -> int:
    """The highest step of `key` the run already holds (-1 if none, or the store cannot say)."""
    if run_id is None:
        return -1
    import mlflow

    try:
        return max((m.step for m in mlflow.MlflowClient(tracking_uri()).get_metric_history(run_id, key)), default=-1)
    except Exception:
        return -1


class MetricLogger:
    """Sends metrics to the run from a background thread: the training loop never waits for the store.

    When the store cannot be reached, points stay buffered in order and are retried every
    `retry_seconds`, with one warning when the outage starts and one line when it ends. `close()`
    waits up to `timeout` seconds for the rest; whatever is still unsent is written to
    `fallback` (JSON lines: key, value, step, timestamp) so nothing is lost. Main process only.
    """

    def __init__(self, run_id: str | None, fallback: str | os.PathLike, retry_seconds: float = 5.0, logged_through: int = -1):
        self.run_id, self.fallback, self.retry_seconds = run_id, Path(fallback), retry_seconds
        self.logged_through = logged_through  # steps the run already has (a resume recomputes them bit for bit)
        self._pending: list = []
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = float("inf")
        self._down_since: float | None = None
        self._thread = None
        if run_id is not None:
            self._thread = threading.Thread(target=self._send_loop, name="mlflow-metrics", daemon=True)
            self._thread.start()

    def log(self, metrics: dict[str, float], step: int, again: bool = False) -> None:
        """Queue `metrics` at `step`; a step the run already has is skipped unless `again` (values that differ when a step
        is done again, such as goodput's)."""
        if self._thread is None or (step <= self.logged_through and not again):
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._cond:
            self._pending.extend(Metric(key, float(value), now, step) for key, value in metrics.items())
            self._cond.notify()

    def _send_loop(self) -> None:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri())
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                batch = self._pending[:1000]  # MLflow's log_batch limit
            try:
                client.log_batch(self.run_id, metrics=batch, synchronous=True)
            except Exception as err:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    print(f"warning: tracking store unreachable ({type(err).__name__}); training goes on, metrics are buffered", flush=True)
                with self._cond:
                    if self._closing and time.monotonic() >= self._deadline:
                        return  # close() writes what is left to the fallback file
                    self._cond.wait(self.retry_seconds)
                continue
            with self._cond:
                del self._pending[: len(batch)]
            if self._down_since is not None:
                print(f"tracking store reachable again after {time.monotonic() - self._down_since:.0f}s; buffered metrics sent", flush=True)
                self._down_since = None

    def close(self, timeout: float = 120.0) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify()
        self._thread.join()  # returns by the deadline (plus one request): nothing is sent after the fallback is written
        with self._cond:
            unsent, self._pending = self._pending, []
        if unsent:
            self.fallback.parent.mkdir(parents=True, exist_ok=True)
            with open(self.fallback, "a") as f:
                for m in unsent:
                    f.write(json.dumps({"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp}) + "\n")
            print(f"warning: {len(unsent)} metric points could not reach the tracking store; they are in {self.fallback}", flush=True)
        self._thread = None


# Parameter names that hold credentials, values shaped like well-known tokens, and the environment
# variables whose values must never appear anywhere in a run.
SECRET_NAME = re.compile(
    r"(^|[._])(token|hub_token|auth_token|access_token|api_key|apikey|password|passwd|secret|secret_key|access_key|private_key"
    r"|credentials?)$",
    re.I,
)
SECRET_VALUE = re.compile(
    r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,})\b"
)
SECRET_ENV = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY",
    "OPENAI_API_KEY",
    "GITHUB_TOKEN",
)
REDACTED = "[redacted]"
TRUNCATED = "...[truncated; full value in the config.yaml artifact]"
MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH


def redact(name: str, value: Any) -> Any:
    """`value`, or REDACTED when its name or its text looks like a credential."""
    text = str(value)
    secrets = [os.environ[k] for k in SECRET_ENV if len(os.environ.get(k, "")) >= 8]
    if (SECRET_NAME.search(name) and value not in (None, "")) or SECRET_VALUE.search(text) or any(s in text for s in secrets):
        return REDACTED
    return value


def redacted_config(config: dict, prefix: str = "") -> dict:
    return {k: redacted_config(v, f"{prefix}{k}.") if isinstance(v, dict) else redact(f"{prefix}{k}", v) for k, v in config.items()}


def safe_params(config: dict) -> dict[str, str]:
    """The config flattened to dotted names, secrets redacted, values cut to MLflow's limit with a marker."""
    params = {}
    for name, value in flatten(redacted_config(config)).items():
        text = str(value)
        params[name] = text if len(text) <= MAX_PARAM_LENGTH else text[: MAX_PARAM_LENGTH - len(TRUNCATED)] + TRUNCATED
    return params


def launcher_config_file() -> Path | None:
    """The `--config_file` given to `accelerate launch`, read from the launcher's command line."""
    try:
        import psutil

        for proc in psutil.Process().parents()[:3]:
            args = proc.cmdline()
            if "--config_file" in args[:-1]:
                return Path(proc.cwd()) / args[args.index("--config_file") + 1]
    except Exception:  # no launcher, or a process we may not inspect
        return None
    return None


def run_tags(accelerator: Accelerator, recipe: str, resumed_from_step: int) -> dict[str, str]:
    """What runs are filtered and grouped by in the UI."""
    world = accelerator.num_processes
    commit, dirty = git_state()
    config_file = launcher_config_file()
    tags = {
        "recipe": recipe,
        "accelerate_config": config_file.name if config_file else "none",
        "distributed_type": accelerator.distributed_type.value,
        "world_size": str(world),
        "num_nodes": str(max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))),
        "mixed_precision": str(accelerator.mixed_precision),  # as resolved: the param TrainingArguments.mixed_precision says what was asked
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # AVX2 CPUs run fp32 under auto: bf16 would be emulated
        "git_commit": commit or "unknown",
        "git_dirty": str(dirty).lower() if dirty is not None else "unknown",
        "host": socket.gethostname(),
        "resumed_from_step": str(resumed_from_step),
    }
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        tags["zero_stage"] = str(accelerator.state.deepspeed_plugin.zero_stage)
    tags.update({f"version.{package}": version for package, version in package_versions().items()})
    return tags


def log_run_artifacts(accelerator: Accelerator, config: dict) -> None:
    """On a new run: the resolved config (redacted), the launcher and DeepSpeed configs, the environment."""
    if not accelerator.is_main_process:
        return
    import mlflow

    mlflow.log_text(yaml.safe_dump(redacted_config(config), sort_keys=False), "config.yaml")
    mlflow.log_text(environment_report(), "environment.txt")
    if (config_file := launcher_config_file()) is not None and config_file.is_file():
        mlflow.log_text(config_file.read_text(), f"accelerate_config/{config_file.name}")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        mlflow.log_dict(accelerator.state.deepspeed_plugin.deepspeed_config, "deepspeed_config.json")


def log_model(model_dir: str | os.PathLike, task: str, registered_name: str | None = None) -> str | None:
    """Log an exported model (a `save_pretrained` folder) to the active run as an MLflow transformers model.

    Loadable with `mlflow.transformers.load_model` / `mlflow.pyfunc.load_model`; registered as a new
    version of `registered_name` when given. Returns the model URI, or None when it could not be
    logged: the export on disk is the deliverable, so a tracking failure is a warning, not a crash.
    """
    import mlflow

    if mlflow.active_run() is None:
        return None
    try:
        import mlflow.transformers
        import transformers

        model_class, processor_key, processor_class = {
            "text-generation": ("AutoModelForCausalLM", "tokenizer", "AutoTokenizer"),
            "text-classification": ("AutoModelForSequenceClassification", "tokenizer", "AutoTokenizer"),
            "image-classification": ("AutoModelForImageClassification", "image_processor", "AutoImageProcessor"),
        }[task]
        components = {
            "model": getattr(transformers, model_class).from_pretrained(model_dir),
            processor_key: getattr(transformers, processor_class).from_pretrained(model_dir),
        }
        # the requirements are ours, pinned: MLflow's own inference imports packages we do not use (torchvision)
        pins = [
            f"{package}=={version}" for package, version in package_versions().items() if package in ("torch", "transformers", "accelerate")
        ]
        info = mlflow.transformers.log_model(
            components, name="model", task=task, registered_model_name=registered_name, pip_requirements=pins
        )
    except Exception as err:
        print(f"warning: the model in {model_dir} was not logged to MLflow ({type(err).__name__}: {err})", flush=True)
        return None
    return info.model_uri


def end_run(status: str) -> None:
    """End the active MLflow run of this process (if any) with `status`: FINISHED, KILLED or FAILED."""
    if "mlflow" not in sys.modules:
        return
    import mlflow

    if mlflow.active_run() is not None:
        try:
            mlflow.end_run(status=status)
        except Exception as err:  # the store is down: the run keeps its last status, training is not failed for it
            print(f"warning: could not mark the MLflow run {status} ({type(err).__name__})", flush=True)


@contextlib.contextmanager
def run_status() -> Iterator[None]:
    """Wrap a recipe's main(): an exception ends its run FAILED, Ctrl-C ends it KILLED."""
    try:
        yield
    except KeyboardInterrupt:
        end_run("KILLED")
        raise
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            end_run("FAILED")
        raise
    except BaseException:
        end_run("FAILED")
        raise
