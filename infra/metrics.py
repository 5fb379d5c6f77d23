"""The training metrics: built in one place (`TrainMetrics.collect`), throughput, the pace after the first steps
(`EtaCheck`), FLOPs and classification scores.

A new per-step metric is a line in `TrainMetrics.collect` (and its test in tests/test_tracking.py).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch


class Throughput:
    """Counts units (tokens, images) and steps since the last `rate()` call and divides by the wall time."""

    def __init__(self, unit: str = "tokens"):
        self.unit = unit
        self._start = time.perf_counter()
        self._tokens = 0
        self._steps = 0
        self._waited = 0.0

    def add(self, tokens: int, steps: int = 1) -> None:
        self._tokens += tokens
        self._steps += steps

    def waited(self, seconds: float) -> None:
        """Time the loop spent waiting for data (the share of the step the loader did not hide)."""
        self._waited += seconds

    def restart(self) -> None:
        """Forget the window so far (a compiling step is not throughput)."""
        self._start, self._tokens, self._steps, self._waited = time.perf_counter(), 0, 0, 0.0

    def rate(self) -> dict[str, float]:
        """units/s, and seconds per step and of data wait per step, since the previous call (nothing if no step was
        counted); then starts a new window."""
        if not self._steps:
            self.restart()
            return {}
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        steps = max(self._steps, 1)
        out = {f"{self.unit}_per_second": self._tokens / elapsed, "step_time": elapsed / steps, "data_wait": self._waited / steps}
        self._start, self._tokens, self._steps, self._waited = now, 0, 0, 0.0
        return out


class TrainMetrics:
    """What is logged every `logging_steps`: the mean loss of the window's finite steps, the learning rate, progress,
    throughput and (on GPUs whose peak is known) model FLOPs utilisation. A compiled model's first step in a process
    (where it compiles) is left out of the throughput; the compile time is logged on its own."""

    def __init__(self, accelerator, unit: str, flops_per_unit: float | None, compiled: bool = False, sources: list[str] = ()):
        self.accelerator, self.unit, self.flops_per_unit = accelerator, unit, flops_per_unit
        self.compiled, self.compiling = compiled, compiled
        self.sources = list(sources)  # a data_mixture's: its loss per source, over the window's finite steps
        self.by_source = torch.zeros(2, len(self.sources), device=accelerator.device)  # loss sums, items
        self.step_by_source = torch.zeros_like(self.by_source)
        self.peak = peak_bf16_flops(torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else None)
        self.meter = Throughput(unit)
        self.loss_sum, self.loss_count = torch.zeros((), device=accelerator.device), 0
        # the recipe's own metrics (infra.job.LossOutput.metrics): sums and samples of the window's kept steps, and of
        # the step under way; the names as the loss gives them (the same code on every rank gives the same names)
        self.recipe: dict[str, torch.Tensor] = {}
        self.step_recipe: dict[str, torch.Tensor] = {}
        self.recipe_samples = self.step_recipe_samples = 0  # kept on the host: no device copy per micro-batch

    def count_step(self, units: int) -> None:
        """An optimizer step's units (tokens, samples) for the throughput."""
        if self.compiling:
            self.compiling = False
            self.meter.restart()
        else:
            self.meter.add(units)

    def add_loss(self, loss_sum: torch.Tensor, items: torch.Tensor | float) -> None:
        """A finite step: this rank's loss summed over its items, and the items of the whole step (every rank). Left on
        the device: read at the next log."""
        self.loss_sum += loss_sum
        self.loss_count += items

    def add_source_losses(self, sources: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """A micro-batch's per-sample loss sums and items, added to their sources' (kept if the step is)."""
        self.step_by_source.index_add_(1, sources, torch.stack([sums.float(), counts.float()]))

    def add_recipe_metrics(self, metrics: dict[str, torch.Tensor], samples: int) -> None:
        """A micro-batch's recipe metrics (each summed over its `samples`), added to the step's (kept if the step is)."""
        if metrics:
            self.step_recipe_samples += samples
        for name, value in metrics.items():
            total = self.step_recipe.get(name)
            value = value.detach().float().reshape(1)
            self.step_recipe[name] = value if total is None else total + value

    def end_step(self, keep: bool) -> None:
        if keep:
            self.by_source += self.step_by_source
            for name, total in self.step_recipe.items():
                self.recipe[name] = self.recipe.get(name, 0) + total
            self.recipe_samples += self.step_recipe_samples
        self.step_by_source.zero_()
        self.step_recipe.clear()
        self.step_recipe_samples = 0

    def reset_loss(self) -> None:
        self.loss_sum.zero_()
        self.loss_count = 0
        self.by_source.zero_()
        self.recipe.clear()
        self.recipe_samples = 0

    def collect(self, learning_rate: float, units_seen: int, epoch: int, grad_norm) -> tuple[dict[str, float], float]:
        """The metrics of the window since the last call, and its mean loss per item over every rank (one reduce of the
        loss across ranks; NaN when every step of the window was skipped: the count is the same on every rank)."""
        acc = self.accelerator
        count = float(self.loss_count)
        # one reduce of the loss, of every source's loss sums and items, and of the recipe's metrics and their samples
        names = sorted(self.recipe)
        recipe = [self.recipe[name] for name in names]
        samples = [torch.tensor([float(self.recipe_samples)], device=acc.device)] if names else []
        parts = [self.loss_sum.reshape(1).float(), self.by_source.flatten(), *recipe, *samples]
        reduced = acc.reduce(torch.cat(parts), "sum").tolist()
        mean_loss = reduced[0] / count if count else math.nan
        k = len(self.sources)
        sums, items = reduced[1 : 1 + k], reduced[1 + k : 1 + 2 * k]
        metric_sums = reduced[1 + 2 * k : 1 + 2 * k + len(names)]
        metric_samples = reduced[-1] if names else 0.0
        logged: dict[str, Any] = {
            **({"train/loss": mean_loss} if count else {}),
            **{f"train/loss/{name}": s / n for name, s, n in zip(self.sources, sums, items, strict=True) if n},
            **{f"train/{name}": v / metric_samples for name, v in zip(names, metric_sums, strict=True) if metric_samples},
            "train/learning_rate": learning_rate,
            f"train/{self.unit}_seen": units_seen,
            "train/epoch": epoch,
        }
        logged.update({f"perf/{k}": v for k, v in self.meter.rate().items()})
        if acc.device.type == "cuda":  # the allocator's peak: what the memory estimate (infra.memory) is checked against
            logged["perf/max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(acc.device) / (1 << 30)
        if self.compiled:
            from infra.levers import compile_seconds

            logged["perf/compile_seconds"] = compile_seconds()
        # model FLOPs utilisation, only where the device's peak is known
        if self.peak and self.flops_per_unit and f"perf/{self.unit}_per_second" in logged:
            logged["perf/mfu"] = logged[f"perf/{self.unit}_per_second"] * self.flops_per_unit / (self.peak * acc.num_processes)
        if grad_norm is not None:
            logged["train/grad_norm"] = float(grad_norm)
        self.reset_loss()
        return logged, mean_loss


class EtaCheck:
    """After `after` steps from the start (the first excluded: it compiles and allocates), the pace and the time to the end."""

    def __init__(
        self,
        say,
        start_step: int,
        max_steps: int,
        units_per_step: int,
        budget_hours: float,
        after: int = 10,
        unit: str = "tokens",
    ):
        self.say, self.start_step, self.max_steps = say, start_step, max_steps  # say: a line above the progress bar
        self.units_per_step, self.budget_hours, self.after, self.unit = units_per_step, budget_hours, after, unit
        self._t0: float | None = None

    def step(self, step: int) -> dict[str, float]:
        if step == self.start_step + 1:
            self._t0 = time.perf_counter()
        if self._t0 is None or step != self.start_step + 1 + self.after:
            return {}
        rate = self.after / (time.perf_counter() - self._t0)
        hours = (self.max_steps - step) / rate / 3600
        self.say(
            f"pace: {rate:.2f} steps/s, {rate * self.units_per_step:,.0f} {self.unit}/s; "
            f"{self.max_steps - step} steps to go take ~{_hours(hours)}"
        )
        if self.budget_hours and hours > self.budget_hours:
            self.say(
                f"warning: the run needs ~{_hours(hours)} more, over time_budget_hours={self.budget_hours:g}: "
                "lower max_steps, or add GPUs (python -m infra.plan)"
            )
        return {"perf/eta_hours": hours}


def _hours(h: float) -> str:
    return f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h"


# Dense bf16 peak of one device, in TFLOP/s, from the vendors' data sheets (no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}


def peak_bf16_flops(device_name: str | None) -> float | None:
    """Peak bf16 FLOP/s of a device by its name (torch.cuda.get_device_name), or None when unknown (CPU included)."""
    if not device_name:
        return None
    name = device_name.upper()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # the most specific name first: "H100 PCIe" before "H100"
        if key.upper() in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward) plus attention's 12 * layers * hidden * seq."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def classification_scores(confusion) -> dict[str, float]:
    """Accuracy and macro F1 from a confusion matrix (rows: true class, columns: predicted), summed over every rank."""
    confusion = confusion.double()
    true_positive = confusion.diagonal()
    predicted, actual = confusion.sum(0), confusion.sum(1)
    f1 = 2 * true_positive / (predicted + actual).clamp(min=1)
    present = (actual + predicted) > 0  # classes neither present nor predicted do not count (as in scikit-learn)
    return {
        "eval/accuracy": float(true_positive.sum() / confusion.sum().clamp(min=1)),
        "eval/f1": float(f1[present].mean()) if present.any() else 0.0,
    }


def evaluate_classifier(accelerator, outputs, num_labels: int) -> dict[str, float]:
    """Loss (weighted by samples), accuracy and macro F1 over held-out batches, all ranks together.

    `outputs` yields (model output with .loss and .logits, labels) for each of this rank's batches.
    """
    import torch

    confusion = torch.zeros(num_labels, num_labels, device=accelerator.device)
    loss = torch.zeros(2, device=accelerator.device)  # sum of per-batch mean losses x samples, samples
    for out, labels in outputs:
        ones = torch.ones(len(labels), device=accelerator.device)
        loss += torch.stack([out.loss.float() * len(labels), ones.sum()])
        confusion.index_put_((labels, out.logits.argmax(-1)), ones, accumulate=True)
    loss_sum, samples = accelerator.reduce(loss, "sum").tolist()
    return {"eval/loss": loss_sum / samples, **classification_scores(accelerator.reduce(confusion, "sum"))}
