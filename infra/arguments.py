"""Every flag a recipe shares, `TrainingArguments`: one flat command line and YAML, made of the sections each component
declares beside itself (a new flag goes there), and what neither section can check alone.

    args = TrainingArguments(max_steps=100, global_batch_size=32)   # ConfigError: one line naming the field
    check_data_and_training(data_args, args)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from infra.checkpoint import CheckpointConfig, RetentionConfig, SaveClockConfig
from infra.config import require
from infra.data import DataArguments
from infra.guard import NonFiniteConfig
from infra.health import HealthConfig
from infra.levers import LeverConfig
from infra.optim import OptimizerConfig
from infra.precision import PrecisionConfig
from infra.preemption import PreemptionConfig
from infra.preflight import PreflightConfig
from infra.reduction import ReductionConfig
from infra.replicas import ReplicaConfig
from infra.sdc import SdcConfig
from infra.tracking import TrackingConfig


@dataclass
class LoopConfig:
    """Loop, logging and eval flags (part of TrainingArguments)."""

    _argument_group_name = "training loop, logging and eval"  # its heading in --help

    output_dir: str = field(default="runs/default", metadata={"help": "Where checkpoints, the exported model and logs go."})
    seed: int = field(default=42, metadata={"help": "Seed for model init, data order and dropout."})
    full_determinism: bool = field(
        default=False,
        metadata={
            "help": "PyTorch's deterministic algorithms in every kernel (transformers' enable_full_determinism, as its "
            "Trainer's flag of this name): runs repeat bit for bit where kernels would add in an order that varies, e.g. "
            "inductor's scatter-adds on a CPU with several threads a process, or atomics on a GPU. Slower; an operation "
            "without a deterministic kernel stops the run with PyTorch's error naming it."
        },
    )
    max_steps: int = field(default=200, metadata={"help": "Optimizer steps to train for."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Samples per process per micro-step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    global_batch_size: int = field(
        default=0,
        metadata={
            "help": "Samples per optimizer step over every process. When set, it decides gradient_accumulation_steps at "
            "each launch (global / (per-device batch x processes)), so a job that comes back on fewer or more processes "
            "keeps its batch. 0: per-device batch x processes x gradient_accumulation_steps."
        },
    )
    logging_steps: int = field(default=10, metadata={"help": "Log metrics every N optimizer steps."})
    log_level: Literal["info", "debug"] = field(
        default="info",
        metadata={
            "help": "info: the run's own lines (preflight, progress, saves, evals, faults, the end). debug: the libraries' "
            "too (MLflow's INFO, accelerate's warning at each save of tied weights, progress bars on every process)."
        },
    )
    eval_steps: int = field(
        default=0,
        metadata={"help": "Evaluate on the held-out samples every N optimizer steps (0: only at the end); recipes without eval ignore it."},
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Samples per process per eval batch."})

    def __post_init__(self):
        for name in (
            "max_steps",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
        ):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.eval_steps >= 0, "eval_steps", self.eval_steps, "an integer >= 0")
        require(self.global_batch_size >= 0, "global_batch_size", self.global_batch_size, "an integer >= 0 (0: not set)")
        require(
            "://" not in self.output_dir,
            "output_dir",
            self.output_dir,
            "a local or shared folder (checkpoints go to object storage with checkpoint_upload_dir)",
        )


@dataclass
class TrainingArguments(
    ReplicaConfig,
    TrackingConfig,
    PreflightConfig,
    HealthConfig,
    SdcConfig,
    NonFiniteConfig,
    PreemptionConfig,
    CheckpointConfig,
    RetentionConfig,
    SaveClockConfig,
    PrecisionConfig,
    OptimizerConfig,
    ReductionConfig,
    LeverConfig,
    LoopConfig,
):
    """What every recipe shares: each section is declared, documented and validated beside the component that reads
    it (a new flag goes there). Flat on the command line and in YAML; names follow `transformers.TrainingArguments`
    where a field means the same thing; MLflow and checkpoints record them as `TrainingArguments.<name>`."""

    def __post_init__(self):
        for section in reversed(type(self).__mro__[1:]):  # each section's own checks, LoopConfig's first
            if "__post_init__" in vars(section):
                vars(section)["__post_init__"](self)
        if self.lr_scheduler_type == "warmup_stable_decay":  # what neither section can check alone
            decay = max(1, round(self.decay_ratio * self.max_steps))
            accepted = f"at most max_steps - decay steps = {self.max_steps - decay} with warmup_stable_decay"
            require(self.warmup_steps <= self.max_steps - decay, "warmup_steps", self.warmup_steps, accepted)
        if self.fault_tolerance == "replicas":
            accepted = "> 0 with fault_tolerance=replicas: the samples of every step, which the live replica groups split"
            require(self.global_batch_size > 0, "global_batch_size", self.global_batch_size, accepted)
        if self.straggler_action == "rebalance":
            accepted = f"at most the even share of a micro-step, per_device_train_batch_size={self.per_device_train_batch_size}"
            require(
                self.straggler_min_samples <= self.per_device_train_batch_size,
                "straggler_min_samples",
                self.straggler_min_samples,
                accepted,
            )

    @property
    def own_dir(self) -> str:
        """Where this job's own files go (its lock, goodput, sample trace, hang reports, stop record, MLflow run id): the
        output_dir; with replica groups each group's folder in it (checkpoints and final/ stay in output_dir)."""
        if self.fault_tolerance == "replicas":
            return f"{self.output_dir}/replicas/{self.replica_group_id}"
        return self.output_dir


def check_data_and_training(data_args: DataArguments, args: TrainingArguments) -> None:
    """What neither section can check alone."""
    if args.fault_tolerance == "replicas":
        accepted = "not set with fault_tolerance=replicas, which reads one dataset (data_dir) for now"
        require(not data_args.data_mixture, "data_mixture", data_args.data_mixture, accepted)
    if args.keep_best and args.metric_for_best_model.startswith("eval/"):
        require(
            data_args.eval_samples > 0, "eval_samples", data_args.eval_samples, f"> 0 to rank checkpoints by {args.metric_for_best_model}"
        )
