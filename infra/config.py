"""Typed configuration: dataclasses + a YAML file (`--config`) + command-line overrides.

Built on `transformers.HfArgumentParser`. YAML values go through the same argparse type
conversion as command-line flags, so a value is checked the same way wherever it comes from.
Everything is validated before any process group, file or MLflow run exists; a bad value ends
the program with one line naming the field, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import HfArgumentParser


class ConfigError(ValueError):
    """A configuration problem, phrased for the user in one sentence."""


@dataclass
class TrainingArguments:
    """What every recipe shares: the loop, the optimizer, checkpoints and tracking.

    Names follow `transformers.TrainingArguments` where a field means the same thing.
    """

    output_dir: str = field(default="runs/default", metadata={"help": "Where checkpoints, the exported model and logs go."})
    run_name: str | None = field(default=None, metadata={"help": "MLflow run name; generated from the main hyperparameters if unset."})
    experiment_name: str | None = field(default=None, metadata={"help": "MLflow experiment; the recipe's name if unset."})
    report_to: Literal["mlflow", "none"] = field(default="mlflow", metadata={"help": "Experiment tracker to log to."})
    seed: int = field(default=42, metadata={"help": "Seed for model init, data order and dropout."})

    max_steps: int = field(default=200, metadata={"help": "Optimizer steps to train for."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Samples per process per micro-step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate after warmup."})
    warmup_steps: int = field(default=20, metadata={"help": "Linear warmup steps before the cosine decay."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decay floor, as a fraction of learning_rate."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (not applied to norms and biases)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables clipping)."})
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = field(
        default="auto",
        metadata={
            "help": "Autocast precision. auto: bf16 where the device computes it natively (bf16 GPUs; CPUs with AMX or AVX-512-BF16), "
            "fp16 on older GPUs, else fp32 (no). The one place precision is set: a launcher config that asks for another is refused."
        },
    )

    logging_steps: int = field(default=10, metadata={"help": "Log metrics every N optimizer steps."})
    eval_steps: int = field(
        default=0,
        metadata={"help": "Evaluate on the held-out samples every N optimizer steps (0: only at the end); recipes without eval ignore it."},
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Samples per process per eval batch."})
    save_steps: int = field(default=100, metadata={"help": "Save a checkpoint every N optimizer steps (0: only at the end)."})
    save_every_minutes: str = field(
        default="30",
        metadata={
            "help": "Also save when this many minutes of wall clock passed since the last save (0: off), whichever of this and "
            "save_steps comes first; 'auto' picks the Young/Daly interval sqrt(2 * save cost * mtbf_hours) from measured saves."
        },
    )
    mtbf_hours: float = field(default=24.0, metadata={"help": "Mean time between failures of the whole job, for save_every_minutes=auto."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep the newest N checkpoints (None keeps all)."})
    keep_best: int = field(default=0, metadata={"help": "Also keep the best N checkpoints by metric_for_best_model (0: off)."})
    metric_for_best_model: str = field(default="train/loss", metadata={"help": "Logged metric that ranks checkpoints for keep_best."})
    greater_is_better: bool = field(default=False, metadata={"help": "Whether a larger metric_for_best_model is better."})
    save_milestone_steps: int = field(default=0, metadata={"help": "Keep every checkpoint whose step is a multiple of N forever (0: off)."})
    async_save: bool = field(
        default=False,
        metadata={
            "help": "DDP: copy the state to CPU memory and write it from a thread while training goes on (final saves stay synchronous)."
        },
    )
    verify_checksums: bool = field(
        default=True, metadata={"help": "Check every file's checksum before resuming (sizes are always checked)."}
    )
    preemption_grace_seconds: float = field(
        default=120.0, metadata={"help": "After SIGTERM/SIGUSR1, the time allowed to save and exit before the process stops anyway."}
    )
    resume_from_checkpoint: str = field(
        default="auto",
        metadata={"help": "'auto' resumes from the newest checkpoint in output_dir, 'none' starts fresh, or a checkpoint path."},
    )
    ddp_timeout: int = field(
        default=1800, metadata={"help": "Seconds a collective may wait during start-up and the first step before the job fails."}
    )
    ddp_step_timeout: int = field(
        default=900,
        metadata={
            "help": "After the first step, seconds a collective may wait before the job fails naming the rank that is behind "
            "(0: keep ddp_timeout). Must exceed the longest checkpoint save."
        },
    )
    max_bad_steps: int = field(
        default=3, metadata={"help": "Non-finite steps in a row (each skipped: no optimizer step) before on_bad_steps acts."}
    )
    on_bad_steps: Literal["rollback", "stop"] = field(
        default="rollback",
        metadata={"help": "rollback: reload the newest checkpoint and skip the data since it; stop: end the run with a message."},
    )
    max_rollbacks: int = field(default=3, metadata={"help": "Rollbacks allowed in one run before it stops."})
    straggler_window_steps: int = field(
        default=50, metadata={"help": "Compare per-rank forward and data-wait times every N steps (0: off)."}
    )
    straggler_factor: float = field(default=1.5, metadata={"help": "A rank slower than this x the median is a straggler."})
    straggler_patience: int = field(default=3, metadata={"help": "Windows in a row a rank must be slow before it is reported."})
    straggler_action: Literal["warn", "checkpoint_and_exit"] = field(
        default="warn",
        metadata={"help": "checkpoint_and_exit: save and exit with code 75 so the job is restarted without the slow node."},
    )
    preflight: bool = field(
        default=True, metadata={"help": "Check devices, a collective, data, a checkpoint round trip, disk and MLflow before training."}
    )
    preflight_only: bool = field(
        default=False, metadata={"help": "Run the preflight (data checksums included), print it, and exit (make doctor)."}
    )
    time_budget_hours: float = field(
        default=0.0, metadata={"help": "Warn after the first steps if the run needs longer than this (0: no budget)."}
    )
    log_model: bool = field(
        default=False,
        metadata={"help": "Log the exported model to the MLflow run as an MLflow transformers model (loadable with mlflow.pyfunc)."},
    )
    register_model: str | None = field(
        default=None, metadata={"help": "Also register the logged model in the MLflow model registry under this name (implies log_model)."}
    )

    @property
    def save_interval_minutes(self) -> float | str | None:
        """save_every_minutes as a number, 'auto', or None when it is neither."""
        if str(self.save_every_minutes).strip() == "auto":
            return "auto"
        try:
            minutes = float(self.save_every_minutes)
        except ValueError:
            return None
        return minutes if minutes >= 0 else None

    def __post_init__(self):
        for name in (
            "max_steps",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
            "max_bad_steps",
            "straggler_patience",
        ):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        for name in (
            "warmup_steps",
            "save_steps",
            "eval_steps",
            "ddp_timeout",
            "ddp_step_timeout",
            "keep_best",
            "save_milestone_steps",
            "max_rollbacks",
            "straggler_window_steps",
        ):
            require(getattr(self, name) >= 0, name, getattr(self, name), "an integer >= 0")
        require(self.learning_rate > 0, "learning_rate", self.learning_rate, "a number > 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        require(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, "a number >= 0")
        require(self.save_interval_minutes is not None, "save_every_minutes", self.save_every_minutes, "a number of minutes >= 0 or 'auto'")
        require(self.mtbf_hours > 0, "mtbf_hours", self.mtbf_hours, "a number > 0")
        require(self.straggler_factor > 1, "straggler_factor", self.straggler_factor, "a number > 1")
        require(self.time_budget_hours >= 0, "time_budget_hours", self.time_budget_hours, "a number of hours >= 0")
        require(self.preemption_grace_seconds > 0, "preemption_grace_seconds", self.preemption_grace_seconds, "a number > 0")
        require(
            self.save_total_limit is None or self.save_total_limit >= 1,
            "save_total_limit",
            self.save_total_limit,
            "an integer >= 1 or null",
        )
        if self.register_model is not None:
            require(bool(re.fullmatch(r"[\w.\-/ ]{1,256}", self.register_model)), "register_model", self.register_model, "a model name")
            self.log_model = True
        if self.resume_from_checkpoint not in ("auto", "none"):
            require(
                Path(self.resume_from_checkpoint).is_dir(),
                "resume_from_checkpoint",
                self.resume_from_checkpoint,
                "'auto', 'none' or an existing checkpoint directory",
            )


@dataclass
class DataArguments:
    data_dir: str = field(default="data/stdlib", metadata={"help": "Prepared shards (each recipe's YAML names its own)."})
    eval_samples: int = field(
        default=0, metadata={"help": "Hold out the last N samples of data_dir for eval (every eval_steps and at the end); 0: no eval."}
    )
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank."})
    shuffle_window: int = field(
        default=1 << 18, metadata={"help": "Samples shuffled together after the shards are shuffled (see infra.data.loader.EpochOrder)."}
    )
    verify_data_checksums: bool = field(
        default=False, metadata={"help": "sha256 every shard before training (in the preflight, on rank 0; make doctor always does)."}
    )
    trace_samples: bool = field(default=False, metadata={"help": "Log each step's global sample ids to OUTPUT_DIR/trace/rank{r}.jsonl."})

    def __post_init__(self):
        require(self.num_workers >= 0, "num_workers", self.num_workers, "an integer >= 0")
        require(self.eval_samples >= 0, "eval_samples", self.eval_samples, "an integer >= 0")
        require(self.shuffle_window >= 1, "shuffle_window", self.shuffle_window, "an integer >= 1")


def check_data_and_training(data_args: DataArguments, args: TrainingArguments) -> None:
    """What neither section can check alone."""
    if args.keep_best and args.metric_for_best_model.startswith("eval/"):
        require(
            data_args.eval_samples > 0, "eval_samples", data_args.eval_samples, f"> 0 to rank checkpoints by {args.metric_for_best_model}"
        )


def require(ok: bool, name: str, value: Any, accepted: str) -> None:
    """Raise a one-sentence ConfigError unless `ok`."""
    if not ok:
        raise ConfigError(f"{name}={value!r} is not valid: expected {accepted}")


class _Parser(HfArgumentParser):
    """HfArgumentParser whose errors are exceptions rather than a usage dump and exit."""

    def error(self, message):
        message = re.sub(r"argument --(\w+)/--[\w-]+", r"argument --\1", message)
        bad_type = re.fullmatch(r"argument --(\w+): invalid (\w+) value: (.*)", message)
        if bad_type:
            name, kind, value = bad_type.groups()
            message = f"{name}={value} is not valid: expected {_KINDS.get(kind, kind)}"
        raise ConfigError(message)


_KINDS = {"int": "an integer", "float": "a number", "string_to_bool": "true or false"}


def parse_config(dataclass_types: tuple[type, ...], argv: list[str] | None = None, check=None) -> tuple:
    """Parse `--config file.yaml` plus command-line overrides into the given dataclasses.

    `check(*parsed)` may raise ConfigError for what involves fields of several dataclasses. On any
    problem prints one line to stderr and exits with status 2, having created nothing.
    """
    try:
        parsed = _parse(dataclass_types, sys.argv[1:] if argv is None else list(argv))
        if check is not None:
            check(*parsed)
        return parsed
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _parse(dataclass_types: tuple[type, ...], argv: list[str]) -> tuple:
    parser = _Parser(dataclass_types, allow_abbrev=False)  # a typo must not silently match a longer flag
    parser.add_argument("--config", type=str, default=None, help="YAML file of field: value; flags override it.")
    known, _ = parser.parse_known_args(argv)  # --help prints and exits here

    fields = {f.name: f for dtype in dataclass_types for f in dataclasses.fields(dtype) if f.init}
    yaml_argv, nulls = [], []
    if known.config is not None:
        values = _read_yaml(known.config)
        for key, value in values.items():
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"{known.config}: unknown key '{key}'{hint}")
            if value is None:
                nulls.append(key)
            else:
                yaml_argv += _as_flags(key, value)
        try:  # the YAML alone first, so that an error names the file it came from
            parser.parse_args_into_dataclasses(args=yaml_argv, look_for_args_file=False)
        except ConfigError as err:
            raise ConfigError(f"{known.config}: {err}") from None

    cli = _without_flag(argv, "--config")
    *outputs, unknown = parser.parse_args_into_dataclasses(args=yaml_argv + cli, look_for_args_file=False, return_remaining_strings=True)
    if unknown:
        flag = next((a for a in unknown if a.startswith("--")), unknown[0])
        close = difflib.get_close_matches(flag.lstrip("-").split("=")[0], fields, n=1)
        hint = f" (did you mean '--{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown argument {' '.join(unknown)!r}{hint}")
    outputs = [o for o in outputs if dataclasses.is_dataclass(o)]
    cli_keys = {a[2:].split("=")[0].replace("-", "_") for a in cli if a.startswith("--")}
    for obj in outputs:  # `key: null` in the YAML, unless a flag set the key again
        names = {f.name for f in dataclasses.fields(obj)}
        for key in set(nulls) & names - cli_keys:
            setattr(obj, key, None)
        if set(nulls) & names and hasattr(obj, "__post_init__"):
            obj.__post_init__()
    return tuple(outputs)


def _read_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        values = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    return values


def _as_flags(key: str, value: Any) -> list[str]:
    if isinstance(value, list):
        return [f"--{key}", *map(str, value)]
    if isinstance(value, (dict, tuple, set)):
        raise ConfigError(f"{key}={value!r} is not valid: expected a single value")
    return [f"--{key}", str(value)]


def _without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def resolved(*configs) -> dict[str, dict[str, Any]]:
    """The resolved configuration, one section per dataclass (as saved next to checkpoints)."""
    return {type(c).__name__: dataclasses.asdict(c) for c in configs}


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: the dotted names MLflow shows as params."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def to_json(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True, default=str)
