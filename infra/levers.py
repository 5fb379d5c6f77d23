"""The levers applied to the model before `prepare`, one flag each: activation checkpointing (memory for compute)
and torch.compile (start-up time for speed).

Both are decided by the recipe's config alone; a launcher config that asks otherwise is refused, so a run never
does what one file says and not the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, TorchDynamoPlugin

from infra.config import require
from infra.distributed import LaunchError, requested_engine

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # aot_eager and eager: to find out whether inductor is at fault


@dataclass
class LeverConfig:
    """Activation checkpointing and torch.compile (part of TrainingArguments)."""

    _argument_group_name = "memory and speed levers"  # its heading in --help

    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Activation checkpointing: keep only each layer's input and recompute the rest in the backward pass "
            "(less memory, about a third more compute). FSDP's own under FSDP, else transformers' non-reentrant one."
        },
    )

    torch_compile: bool = field(
        default=False,
        metadata={
            "help": "Compile the model's repeated blocks (its decoder or encoder layers) with torch.compile, each in place "
            "(regional compilation: one compile serves every layer, and checkpoints keep the eager names, so compiled and "
            "eager runs resume each other's). The compile time is logged apart from the throughput (perf/compile_seconds)."
        },
    )
    torch_compile_mode: str = field(default="default", metadata={"help": f"torch.compile's mode: {', '.join(COMPILE_MODES)}."})
    torch_compile_backend: str = field(
        default="inductor", metadata={"help": f"torch.compile's backend: {', '.join(COMPILE_BACKENDS)} (the last two to debug)."}
    )

    def __post_init__(self):
        accepted = f"one of {', '.join(COMPILE_MODES)}"
        require(self.torch_compile_mode in COMPILE_MODES, "torch_compile_mode", self.torch_compile_mode, accepted)
        accepted = f"one of {', '.join(COMPILE_BACKENDS)}"
        require(self.torch_compile_backend in COMPILE_BACKENDS, "torch_compile_backend", self.torch_compile_backend, accepted)


def checkpoint_activations(accelerator: Accelerator, model: torch.nn.Module, wanted: bool) -> None:
    """Activation checkpointing (`gradient_checkpointing`), before `prepare`: under FSDP its own (accelerate applies it
    to the wrapped units), else transformers' non-reentrant one. The recipe's field is the one source of truth: a
    launcher config with `fsdp_activation_checkpointing: true` and the field false is refused."""
    if accelerator.distributed_type == DistributedType.FSDP:
        launcher = os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
        if launcher and not wanted:
            raise LaunchError(
                "the launcher config sets fsdp_activation_checkpointing: true but the recipe's gradient_checkpointing is false: "
                "set gradient_checkpointing: true (the one place it is decided) and drop it from the launcher config"
            )
        accelerator.state.fsdp_plugin.activation_checkpointing = wanted
        return
    if wanted:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise LaunchError(f"gradient_checkpointing: {type(model).__name__} does not support it")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


SHARDING_ENGINES = (DistributedType.DEEPSPEED, DistributedType.FSDP)


def dynamo_plugin(config: LeverConfig) -> TorchDynamoPlugin:
    """What the Accelerator is to compile, after refusing a launcher config whose dynamo settings (ACCELERATE_DYNAMO_*)
    differ from the recipe's torch_compile fields.

    Under DeepSpeed and FSDP: accelerate's own regional compilation, in place (so the parameters keep their names),
    after FSDP's activation checkpointing and before its sharding. Elsewhere nothing: accelerate would replace each
    block by a wrapper whose parameters are named `_orig_mod`, and checkpoints would no longer load into an eager
    model; `compile_blocks` compiles those in place instead."""
    launcher = TorchDynamoPlugin()  # from the launcher's variables, as the Accelerator would read them
    backend = launcher.backend.value.lower()
    if backend != "no" and (
        not config.torch_compile or (backend, launcher.mode) != (config.torch_compile_backend, config.torch_compile_mode)
    ):
        recipe = f"torch_compile: {str(config.torch_compile).lower()}"
        if config.torch_compile:
            recipe += f" (backend {config.torch_compile_backend}, mode {config.torch_compile_mode})"
        raise LaunchError(
            f"the launcher config asks for torch.compile (backend {backend}, mode {launcher.mode}) but the recipe has {recipe}: "
            "set torch_compile (and its mode) in the recipe's config, the one place it is decided, and drop dynamo_config "
            "from the launcher config"
        )
    if config.torch_compile and requested_engine() in SHARDING_ENGINES:
        return regional(config)
    return TorchDynamoPlugin(backend="no")


def regional(config: LeverConfig) -> TorchDynamoPlugin:
    return TorchDynamoPlugin(backend=config.torch_compile_backend, mode=config.torch_compile_mode, use_regional_compilation=True)


def compile_blocks(accelerator: Accelerator, model: torch.nn.Module, config: LeverConfig) -> None:
    """torch.compile on the model's repeated blocks (and separately on the rest), in place, before `prepare` wraps it
    in DDP: accelerate's in-place regional compilation, the one it runs itself under DeepSpeed and FSDP."""
    if not config.torch_compile or accelerator.distributed_type in SHARDING_ENGINES:
        return
    from accelerate.utils import compile_regions_fsdp2  # in place; usable under every engine despite its name

    compile_regions_fsdp2(model, **regional(config).to_kwargs())


def compile_seconds() -> float:
    """The wall time torch.compile has spent in this process so far (recompiles included)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
