"""Mixed precision, decided in one place: the recipe's `mixed_precision` field, `auto` by default.

`auto` picks what the hardware computes natively:

- a CUDA GPU with bf16 (Ampere and newer): `bf16`;
- an older CUDA GPU (V100, T4): `fp16`, with accelerate's loss scaler (its tensor cores compute fp16; fp32 would be
  several times slower there);
- a CPU with AMX (Sapphire Rapids and newer Xeons): `bf16`;
- a CPU with AVX-512-BF16 but no AMX (some Xeons, AMD Zen 4 and newer): what a probe measures faster. The instruction
  set does not decide there: the default pretraining run took 0.86x fp32's time in bf16 on an AMD EPYC of this kind
  and 1.28x on an Intel Xeon of this kind. The probe times a forward and backward of one decoder block of the default
  model's shapes in both precisions (about a second) and bf16 is chosen when it is at least BF16_MARGIN times as fast; the
  result is cached per machine (CPU model, torch version, threads) in `~/.cache/infra/precision_probe.json`
  (`INFRA_PRECISION_PROBE_CACHE` names another file), so the processes of a launch, and every later launch, take the
  answer of the first one without measuring again;
- any other CPU (AVX2 only, or not x86): `no`, plain fp32. bf16 there is emulated: on an AVX2 EPYC the default
  pretraining run took 5.7 s a step in bf16 against 0.35 s in fp32.

`bf16`, `fp16` and `no` force a choice. The launcher configs in accelerate_configs/ set no precision; a launcher that
asks for one (`mixed_precision:` in its config file, or `accelerate launch --mixed_precision`) must agree with the
recipe's choice, or the run is refused before it starts. accelerate writes `no` when nothing was asked, so a
launcher's `no` counts as unset.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

CHOICES = ("auto", "bf16", "fp16", "no")
LAUNCHER_ENV = "ACCELERATE_MIXED_PRECISION"  # what `accelerate launch` passes to its processes
PROBE_CACHE_ENV = "INFRA_PRECISION_PROBE_CACHE"
BF16_MARGIN = 1.05  # bf16 must run the probe at least this many times as fast as fp32 (noise must not pick a slower one)


@dataclass
class PrecisionConfig:
    """Precision flag (part of TrainingArguments)."""

    _argument_group_name = "precision"  # its heading in --help

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


def bf16_speedup(repeats: int = 7) -> float:
    """fp32's time over bf16 autocast's for a forward and backward of one pre-norm decoder block of the default
    pretraining model's shapes (8 x 256 tokens, width 128, 4 heads, MLP 344): matmuls, norms, attention and the casts
    between them, in this process's threads. The fastest of `repeats` alternated timings of each, after a warm-up (the
    fastest is what another process's load disturbs least)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    batch, seq, width, heads, mlp = 8, 256, 128, 4, 344
    x = torch.randn(batch, seq, width, generator=gen)
    shapes = {"qkv": (width, 3 * width), "out": (width, width), "up": (width, 2 * mlp), "down": (mlp, width)}
    w = {name: (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).requires_grad_() for name, shape in shapes.items()}

    def once(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            q, k, v = (F.rms_norm(x, (width,)) @ w["qkv"]).view(batch, seq, 3, heads, -1).unbind(2)
            h = (
                x
                + F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2).reshape(x.shape)
                @ w["out"]
            )
            gate, up = (F.rms_norm(h, (width,)) @ w["up"]).chunk(2, dim=-1)
            out = h + (F.silu(gate) * up) @ w["down"]
        out.float().square().mean().backward()
        return time.perf_counter() - start

    once(True), once(False)
    times = {True: [], False: []}
    for _ in range(repeats):
        for bf16 in (True, False):
            times[bf16].append(once(bf16))
    return min(times[False]) / min(times[True])


def probe_cache() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "infra" / "precision_probe.json"
    return Path(os.environ.get(PROBE_CACHE_ENV, default))


def cached_bf16_speedup() -> float:
    """bf16_speedup() of this machine, measured once: the first process holds a lock on the cache while it measures,
    the others (the launch's other ranks, later launches) read its answer."""
    cache = probe_cache()
    key = f"{cpu_description()}; torch {torch.__version__}; {torch.get_num_threads()} threads"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_suffix(".lock"), "w")  # noqa: SIM115 (closed below)
    except OSError:  # no writable cache (a read-only home): measured here and not kept; the preflight checks ranks agree
        return round(bf16_speedup(), 3)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = {}
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(cache.read_text())
        if key not in known:
            known[key] = round(bf16_speedup(), 3)
            partial = cache.with_suffix(".partial")
            with contextlib.suppress(OSError):  # a full disk: the answer holds for this process
                partial.write_text(json.dumps(known, indent=1))
                partial.replace(cache)
        return float(known[key])


def automatic() -> Precision:
    """What `auto` resolves to on this process's device."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", f"auto: {name} computes bf16 natively")
        return Precision("fp16", f"auto: {name} has no native bf16; fp16 with loss scaling")
    capability = torch.backends.cpu.get_cpu_capability()
    if not cpu_has_native_bf16():
        return Precision("no", f"auto: this CPU ({capability}) has no native bf16, which would be emulated and many times slower; fp32")
    if torch.cpu._is_amx_tile_supported():
        return Precision("bf16", f"auto: this CPU computes bf16 natively (AMX; {capability})")
    speedup = cached_bf16_speedup()
    measured = f"bf16 ran a probe of a decoder block {speedup:.2f}x as fast as fp32 on this CPU (AVX-512-BF16, no AMX; {probe_cache()})"
    if speedup >= BF16_MARGIN:
        return Precision("bf16", f"auto: {measured}")
    return Precision("no", f"auto: {measured}, under the {BF16_MARGIN}x bf16 needs; fp32")


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
