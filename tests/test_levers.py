"""The levers applied to the model before `prepare`: gradients unchanged by activation checkpointing and by
torch.compile, less memory with checkpointing, and checkpoints that compiled and eager runs share."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO


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

    from infra.levers import checkpoint_activations

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


MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}

PEAK = """
import sys, torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM
from infra.levers import checkpoint_activations

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
        # freed tensors go back to the kernel (see tests/memory_step.py): glibc otherwise keeps them and the peak drifts
        arm: int(
            subprocess.run(
                [sys.executable, "-c", PEAK, arm], cwd=REPO, capture_output=True, text=True, check=True, env={**os.environ, **MMAP}
            ).stdout.split()[-1]
        )
        for arm in ("off", "on")
    }
    assert 0 < peak["on"] < 0.8 * peak["off"], peak  # 0.65x measured here (AMX Xeon, fp32)


# torch.compile


def test_compiled_blocks_keep_their_names_and_the_eager_gradients(tmp_path):
    """Regional compilation in place, with activation checkpointing on top (the combination big runs use): the same
    parameter names, the eager model's gradients (fp32), and a checkpoint of the compiled model that loads into an eager one."""
    from accelerate import Accelerator

    from infra.levers import LeverConfig, checkpoint_activations, compile_blocks

    eager, inputs = tiny_model("llama")
    compiled, _ = tiny_model("llama")
    accelerator = Accelerator(cpu=True)
    checkpoint_activations(accelerator, compiled, True)
    compile_blocks(accelerator, compiled, LeverConfig(torch_compile=True))
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no `_orig_mod`
    for model in (eager, compiled):
        model(**inputs).loss.backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name

    with torch.no_grad():
        for p in compiled.parameters():
            p.add_(1.0)  # weights the eager model does not have
    prepared = accelerator.prepare(compiled)
    accelerator.save_state(str(tmp_path / "ckpt"))
    reader = Accelerator(cpu=True)
    fresh, _ = tiny_model("llama")
    fresh = reader.prepare(fresh)
    reader.load_state(str(tmp_path / "ckpt"))
    for (name, a), (_, b) in zip(prepared.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_compiled_blocks_recompile_a_bounded_number_of_times_as_rebalanced_shares_change():
    """straggler_action=rebalance changes a rank's samples of a micro-batch window after window. Compiled blocks
    recompile for the second size seen (torch's automatic dynamic shapes: the batch dimension becomes symbolic) and for
    one sample (a size of 1 is always specialized), then never again, whatever the sizes that come."""
    from accelerate import Accelerator
    from torch._dynamo.utils import counters

    from infra.levers import LeverConfig, compile_blocks

    model, _ = tiny_model("llama")
    # when to recompile is dynamo's, whatever the backend: aot_eager's compiles take a second, inductor's ten
    compile_blocks(Accelerator(cpu=True), model, LeverConfig(torch_compile=True, torch_compile_backend="aot_eager"))

    def step(size: int) -> int:
        ids = torch.randint(0, 64, (size, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        return counters["stats"]["unique_graphs"]

    for size in (4, 3, 1):  # the first size, a second one, the floor
        graphs = step(size)
    assert [step(size) for size in (5, 2, 7, 1, 6, 3, 8)] == [graphs] * 7


def test_a_launcher_that_compiles_while_the_recipe_does_not_is_refused(tiny_data, tmp_path):
    """torch_compile is decided in the recipe's config; a launcher config's dynamo_config that disagrees stops the run."""
    out = tmp_path / "out"
    recipe = [str(REPO / "recipes" / "pretrain_clm.py"), "--data_dir", str(tiny_data), "--output_dir", str(out)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}
    proc = subprocess.run([sys.executable, *recipe], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    expected = "launch error: the launcher config asks for torch.compile (backend inductor, mode default) but the recipe has"
    assert last.startswith(expected), proc.stderr
    assert not out.exists() and not (tmp_path / "mlflow.db").exists()


def history(store: Path, key: str) -> dict[int, float]:
    """A metric by step, of the one run in an MLflow store."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def metric(store: Path, key: str) -> float:
    return history(store, key)[max(history(store, key))]


@pytest.mark.slow  # minutes: out of the quick suite (the matrix resumes compiled runs in CI)
def test_compiled_runs_match_eager_ones_and_resume_each_other(small_data, tmp_path):
    """2 processes (DDP over gloo), fp32, no dropout: eager 0->10->20, compiled 0->10, and from each one's step-10
    checkpoint the other kind to 20. Every loss is within 1e-3 of the eager run's at the same step."""
    from tests.conftest import launch

    def run(where: Path, steps: int, compiled: bool):
        args = ["--data_dir", str(small_data), "--output_dir", str(where / "out"), "--max_steps", str(steps), "--warmup_steps", "40"]
        args += ["--hidden_size", "64", "--intermediate_size", "128", "--learning_rate", "1e-2", "--logging_steps", "1"]
        args += ["--save_steps", "10", "--mixed_precision", "no", "--eval_samples", "0", "--torch_compile", str(compiled).lower()]
        proc = launch("cpu.yaml", ["--config", str(REPO / "recipes" / "configs" / "pretrain_clm.yaml"), *args], where)
        assert proc.returncode == 0
        return history(where / "mlflow.db", "train/loss")

    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run(eager, 10, compiled=False)
    run(compiled, 10, compiled=True)
    for name in ("eager", "compiled"):  # each half-way run, continued by the other kind
        shutil.copytree(tmp_path / name, tmp_path / f"{name}_then_other")
    reference = run(eager, 20, compiled=False)
    from_eager = run(tmp_path / "eager_then_other", 20, compiled=True)
    from_compiled = run(tmp_path / "compiled_then_other", 20, compiled=False)
    assert sorted(reference) == sorted(from_eager) == sorted(from_compiled) == list(range(1, 21))
    for got in (from_eager, from_compiled):
        for step, loss in reference.items():
            assert got[step] == pytest.approx(loss, rel=1e-3), (step, got[step], loss)
    for store in (tmp_path / "compiled" / "mlflow.db", tmp_path / "eager_then_other" / "mlflow.db"):  # they compiled, and said how long
        assert metric(store, "perf/compile_seconds") > 0


@pytest.mark.slow
def test_fsdp_activation_checkpointing_leaves_training_as_it_was(small_data, tmp_path):
    """FSDP2 on 2 CPU processes (fp32, no dropout): 4 steps with FSDP's activation checkpointing end at the weights of
    4 steps without it; and the launcher's fsdp_activation_checkpointing without the recipe's field is refused."""
    from safetensors.torch import load_file

    from infra.distributed import FSDP_ON_CPU_ENV
    from tests.conftest import launch

    def run(name: str, *extra: str, config: str = "fsdp.yaml"):
        args = ["--config", str(REPO / "recipes" / "configs" / "pretrain_clm.yaml"), "--data_dir", str(small_data)]
        args += ["--output_dir", str(tmp_path / name), "--max_steps", "4", "--mixed_precision", "no", "--eval_samples", "0"]
        args += ["--report_to", "none", "--hidden_size", "64", "--intermediate_size", "128", *extra]
        return launch(config, args, tmp_path, env={FSDP_ON_CPU_ENV: "1"})

    assert run("off").returncode == 0
    on = run("on", "--gradient_checkpointing", "true")
    assert on.returncode == 0
    a, b = load_file(tmp_path / "off" / "final" / "model.safetensors"), load_file(tmp_path / "on" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    launcher = tmp_path / "fsdp_ac.yaml"  # a user's launcher config that turns FSDP's checkpointing on by itself
    ours = (REPO / "accelerate_configs" / "fsdp.yaml").read_text()
    launcher.write_text(ours.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_activation_checkpointing: true\n"))
    refused = run("refused", config=str(launcher))
    assert refused.returncode != 0
    assert "launch error: the launcher config sets fsdp_activation_checkpointing: true" in refused.stderr
    assert not (tmp_path / "refused").exists()
