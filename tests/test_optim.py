"""The learning-rate schedules: their shapes, and a resumed schedule that gives the straight run's rates."""

from __future__ import annotations

import pytest
import torch

from infra.optim import OptimizerConfig, build_scheduler

STEPS = 20


def fresh(config: OptimizerConfig):
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=config.learning_rate)
    return optimizer, build_scheduler(optimizer, config, STEPS)


def rates(optimizer, scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant_with_warmup", "warmup_stable_decay"])
def test_a_resumed_schedule_gives_the_straight_runs_learning_rates(kind):
    config = OptimizerConfig(learning_rate=1.0, warmup_steps=4, min_lr_ratio=0.1, lr_scheduler_type=kind, decay_ratio=0.25)
    straight = rates(*fresh(config), STEPS)
    optimizer, scheduler = fresh(config)
    first = rates(optimizer, scheduler, 7)
    saved = optimizer.state_dict(), scheduler.state_dict()  # what save_state keeps of them
    optimizer, scheduler = fresh(config)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert first + rates(optimizer, scheduler, STEPS - 7) == straight
    start = 0.1 if kind == "warmup_stable_decay" else 0.0  # transformers' WSD warms up from min_lr_ratio
    assert straight[:5] == pytest.approx([start + (1 - start) * i / 4 for i in range(5)])  # linear warmup to the peak
    after = straight[4:]
    if kind == "constant_with_warmup":
        assert after == [1.0] * len(after)
    elif kind == "warmup_stable_decay":  # stable to step 15, then 5 steps (a quarter of 20) down to the floor
        assert after[:11] == [1.0] * 11 and all(a > b for a, b in zip(after[11:], after[12:], strict=False))
        assert after[-1] == pytest.approx(0.1 + 0.9 / 5)
    else:  # decaying from the peak towards min_lr_ratio (cosine) or 0 (linear) at max_steps
        assert all(a > b for a, b in zip(after, after[1:], strict=False)) and after[-1] > (0.1 if kind == "cosine" else 0.0)


def test_warmup_must_end_before_the_decay_of_warmup_stable_decay():
    from infra.config import ConfigError
    from infra.trainer import TrainingArguments

    with pytest.raises(ConfigError, match="warmup_steps=18 is not valid: expected at most max_steps - decay steps = 15"):
        TrainingArguments(max_steps=20, warmup_steps=18, lr_scheduler_type="warmup_stable_decay", decay_ratio=0.25)


# Activation checkpointing


def tiny_model(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

    torch.manual_seed(0)
    if kind == "llama":
        config = AutoConfig.for_model(
            "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
        )
        inputs = {"input_ids": torch.randint(0, 64, (2, 16))}
        return AutoModelForCausalLM.from_config(config), {**inputs, "labels": inputs["input_ids"]}
    if kind == "bert":
        config = AutoConfig.for_model(
            "bert", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
        )
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        inputs = {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.tensor([0, 1])}
        return AutoModelForSequenceClassification.from_config(config), inputs
    config = AutoConfig.for_model(
        "vit", image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    inputs = {"pixel_values": torch.randn(2, 1, 8, 8), "labels": torch.tensor([0, 1])}
    return AutoModelForImageClassification.from_config(config), inputs


@pytest.mark.parametrize("kind", ["llama", "bert", "vit"])  # the recipes' models: causal LMs, the text and the image classifier
def test_activation_checkpointing_leaves_the_gradients_as_they_were(kind):
    from accelerate import Accelerator

    from infra.distributed import checkpoint_activations

    grads = {}
    for wanted in (False, True):
        model, inputs = tiny_model(kind)
        checkpoint_activations(Accelerator(cpu=True), model, wanted)
        model.train()  # dropout is off in these configs; checkpointing acts in training mode only
        model(**inputs).loss.backward()
        grads[wanted] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        assert model.is_activation_checkpointing == wanted
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        assert torch.allclose(grads[True][name], grad, rtol=1e-5, atol=1e-7), name


PEAK = """
import sys, torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM
from infra.distributed import checkpoint_activations

def status(key):  # kB, from the kernel's accounting of this process
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])

config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4)
model = AutoModelForCausalLM.from_config(config)
checkpoint_activations(Accelerator(cpu=True), model, sys.argv[1] == "on")
model.train()
ids = torch.randint(0, 512, (8, 256))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the present resident size
before = status("VmRSS:")
model(input_ids=ids, labels=ids).loss.backward()
print(status("VmHWM:") - before)
"""


def test_activation_checkpointing_lowers_the_peak_memory():
    """The rise of the peak resident memory over one forward and backward of a 6-layer Llama, batch 8 x 256 tokens,
    each arm in its own process (Linux: the peak is reset just before)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    peak = {
        arm: int(subprocess.run([sys.executable, "-c", PEAK, arm], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()[-1])
        for arm in ("off", "on")
    }
    assert 0 < peak["on"] < 0.8 * peak["off"], peak  # 0.65x measured here (AMX Xeon, fp32)
