"""Mixed precision, decided in one place: the recipe's `mixed_precision` field, `auto` by default.

`auto` picks what the hardware computes natively:

- a CUDA GPU with bf16 (Ampere and newer): `bf16`;
- an older CUDA GPU (V100, T4): `fp16`, with accelerate's loss scaler (its tensor cores compute fp16; fp32 would be
  several times slower there);
- a CPU with AMX or AVX-512-BF16 (Sapphire Rapids and newer Xeons, AMD Zen 4 and newer): `bf16`;
- any other CPU (AVX2 only, or not x86): `no`, plain fp32. bf16 there is emulated: on an AVX2 EPYC the default
  pretraining run took 5.7 s a step in bf16 against 0.35 s in fp32.

`bf16`, `fp16` and `no` force a choice. The launcher configs in accelerate_configs/ set no precision; a launcher that
asks for one (`mixed_precision:` in its config file, or `accelerate launch --mixed_precision`) must agree with the
recipe's choice, or the run is refused before it starts. accelerate writes `no` when nothing was asked, so a
launcher's `no` counts as unset.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Literal

import torch

CHOICES = ("auto", "bf16", "fp16", "no")
LAUNCHER_ENV = "ACCELERATE_MIXED_PRECISION"  # what `accelerate launch` passes to its processes


@dataclass
class PrecisionConfig:
    """Precision flag (part of TrainingArguments)."""

    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = field(
        default="auto",
        metadata={
            "help": "Autocast precision. auto: bf16 where the device computes it natively (bf16 GPUs; CPUs with AMX or AVX-512-BF16), "
            "fp16 on older GPUs, else fp32 (no). The one place precision is set: a launcher config that asks for another is refused."
        },
    )


class PrecisionError(ValueError):
    """The launcher and the recipe ask for different precisions."""


@dataclass(frozen=True)
class Precision:
    value: str  # what the Accelerator gets: bf16, fp16 or no
    reason: str  # why, in words: printed at start and tagged in MLflow

    def __str__(self) -> str:
        return f"mixed precision {self.value} ({self.reason})"


def cpu_has_native_bf16() -> bool:
    """AMX or AVX-512-BF16, with torch's kernels built for AVX-512 (ATEN_CPU_CAPABILITY=avx2 turns them off too)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return False
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def cpu_description() -> str:
    """The CPU as the benchmarks and this module name it: model and torch's capability."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def automatic() -> Precision:
    """What `auto` resolves to on this process's device."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", f"auto: {name} computes bf16 natively")
        return Precision("fp16", f"auto: {name} has no native bf16; fp16 with loss scaling")
    capability = torch.backends.cpu.get_cpu_capability()
    if cpu_has_native_bf16():
        return Precision("bf16", f"auto: this CPU computes bf16 natively (AMX or AVX-512-BF16; {capability})")
    return Precision("no", f"auto: this CPU ({capability}) has no native bf16, which would be emulated and many times slower; fp32")


def resolve(requested: str, launcher: str | None = None) -> Precision:
    """The precision to train with: `requested` (the recipe's field), checked against what the launcher asked for.

    `launcher` defaults to the launcher's environment variable; None or `no` mean it asked for nothing.
    """
    if requested not in CHOICES:
        raise PrecisionError(f"mixed_precision={requested!r} is not valid: expected one of {', '.join(CHOICES)}")
    chosen = automatic() if requested == "auto" else Precision(requested, "mixed_precision set in the recipe's config")
    launcher = os.environ.get(LAUNCHER_ENV) if launcher is None else launcher
    if launcher and launcher.lower() != "no" and launcher.lower() != chosen.value:
        raise PrecisionError(
            f"the launcher asks for mixed_precision={launcher} (its config file or --mixed_precision) but the recipe's "
            f"mixed_precision={requested} gives {chosen.value}{' here (' + chosen.reason + ')' if requested == 'auto' else ''}: "
            f"precision is set in one place, the recipe: pass --mixed_precision {launcher.lower()} to the recipe to force it, "
            "and remove it from the launcher"
        )
    return chosen
