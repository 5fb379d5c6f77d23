"""The main recipe under real `accelerate launch`: 2 CPU processes in one gloo group, exact resume."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import BIN, REPO, free_port, launch

pytestmark = pytest.mark.multiprocess

STEPS = 8


def recipe_args(data: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        str(REPO / "recipes" / "configs" / "pretrain_tiny.yaml"),
        "--data_dir",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        # warmup longer than the run: the schedule does not depend on max_steps, and is not constant
        "--warmup_steps",
        str(2 * STEPS),
        "--learning_rate",
        "1e-2",
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--hidden_size",
        "64",
        "--intermediate_size",
        "128",
        "--attention_dropout",
        "0.1",
        "--logging_steps",
        "2",
        "--save_steps",
        "4",
        "--trace_samples",
        *extra,
    ]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def trace(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / "trace" / f"rank{rank}.jsonl").read_text().splitlines()]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs"


def test_refuses_processes_that_do_not_form_a_group(tmp_path):
    """PITFALLS: the multi-GPU launcher on CPU starts processes that each believe they are alone."""
    script = tmp_path / "alone.py"
    script.write_text("from accelerate import Accelerator\nfrom infra.distributed import check_world\ncheck_world(Accelerator())\n")
    proc = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(REPO / "accelerate_configs" / "cpu.yaml"),
            "--main_process_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "the launcher started 2 processes but this one sees a group of 1" in proc.stderr


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """One uninterrupted 2-process run of 2N steps."""
    tmp = tmp_path_factory.mktemp("straight")
    proc = launch("cpu.yaml", recipe_args(tiny_data, tmp / "out", 2 * STEPS), tmp)
    assert proc.returncode == 0
    return tmp, proc


def test_two_processes_train_as_one_job(straight):
    tmp, proc = straight
    out = tmp / "out"
    assert "world size 2" in proc.stdout
    # each step, the two ranks consumed disjoint halves of one global batch
    rank0, rank1 = trace(out, 0), trace(out, 1)
    assert [r["step"] for r in rank0] == [r["step"] for r in rank1] == [s for s in range(1, 2 * STEPS + 1) for _ in range(2)]
    for a, b in zip(rank0, rank1, strict=True):
        assert len(a["ids"]) == len(b["ids"]) == 4 and not set(a["ids"]) & set(b["ids"])
    # replicas ended identical (the recipe gathers every rank's fingerprint and prints them)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("parameters identical on all 2 ranks"))
    fingerprints = json.loads(line.split("fingerprints ")[1].replace("'", '"'))
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1]
    # a FINISHED MLflow run with the hyperparameters and a falling loss
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["TrainingArguments.max_steps"] == str(2 * STEPS)
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    # the exported model loads with from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").eos_token is not None
    assert torch.equal(model.model.embed_tokens.weight, weights(out)["model.embed_tokens.weight"])


def test_resume_is_bit_exact(straight, tiny_data, tmp_path):
    """N steps, a new launch that auto-resumes for N more == 2N straight, with dropout on."""
    straight_tmp, _ = straight
    out = tmp_path / "out"
    first = launch("cpu.yaml", recipe_args(tiny_data, out, STEPS), tmp_path)
    assert first.returncode == 0
    second = launch("cpu.yaml", recipe_args(tiny_data, out, 2 * STEPS), tmp_path)
    assert second.returncode == 0
    assert f"resumed at step {STEPS}" in second.stdout
    assert_same_weights(straight_tmp / "out", out)
    assert trace(out, 0) == trace(straight_tmp / "out", 0)
    # the resumed launch continued the same MLflow run, with contiguous steps
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(2, 2 * STEPS + 1, 2))
    # retention: the newest save_total_limit checkpoints, each with its manifest
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step_00000012", "step_00000016"]


@pytest.mark.parametrize("accelerate_config", ["zero2.yaml", "zero3.yaml"])
def test_deepspeed_trains_saves_and_resumes_exactly(accelerate_config, tiny_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert launch(accelerate_config, recipe_args(tiny_data, a / "out", 2 * STEPS, "--report_to", "none"), a).returncode == 0
    assert launch(accelerate_config, recipe_args(tiny_data, b / "out", STEPS, "--report_to", "none"), b).returncode == 0
    resumed = launch(accelerate_config, recipe_args(tiny_data, b / "out", 2 * STEPS, "--report_to", "none"), b)
    assert resumed.returncode == 0 and f"resumed at step {STEPS}" in resumed.stdout
    assert "world size 2 (DEEPSPEED)" in resumed.stdout
    assert_same_weights(a / "out", b / "out")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(b / "out" / "final")
