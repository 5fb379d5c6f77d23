"""Silent data corruption (infra.sdc): the copies processes hold identically, compared during the run; a bit flipped in
one process's state caught at the next check, never committed, repaired by training the steps since the newest
checkpoint again (the run ending bit for bit as a clean run), and a process that computes wrong twice stopped."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from infra.sdc import bits, disagreeing
from infra.stopped import SDC_EXIT_CODE
from tests.test_health import run
from tests.test_pretrain import assert_same_weights, global_sequence, recipe_args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_any_one_flipped_bit_changes_a_tensors_number(dtype):
    tensor = (torch.randn(64, 9) * 100).to(dtype)
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    before = bits(tensor)
    assert bits(tensor.clone()) == before  # the same bits, the same number
    for element in (0, 17, tensor.numel() - 1):
        for bit in range(8 * tensor.element_size()):
            flipped = tensor.clone()
            flipped.view(width).view(-1)[element : element + 1].bitwise_xor_(torch.tensor(1, dtype=width) << bit)
            assert bits(flipped) != before, (element, bit)


def test_the_processes_that_differ_from_the_others_are_named():
    rows = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [1, 2, 3]])
    assert disagreeing(rows) == ([2], [1])
    assert disagreeing(rows[:2]) == ([], [])
    assert disagreeing(torch.tensor([[1, 2], [1, 5]])) == ([0, 1], [1])  # two copies: no telling which is wrong
    assert disagreeing(torch.tensor([[1, 2], [7, 2], [1, 3]])) == ([1, 2], [0, 1])


def test_a_check_asked_for_where_no_process_holds_a_copy_is_refused_in_one_line():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from infra.sdc import copies_of, sdc_problem

    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    sharded = SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP)
    ddp = SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU)
    assert copies_of(alone) is None and copies_of(sharded) is None and copies_of(ddp) == "weights and optimizer state"
    assert sdc_problem(alone, "repair") == (
        "sdc_action='repair' is not valid under one process: no process holds a copy of another's state to compare; expected auto or off"
    )
    assert "is not valid under ZeRO-3 or FSDP, where each process holds its own part" in sdc_problem(sharded, "stop")
    assert sdc_problem(sharded, "auto") is None and sdc_problem(ddp, "repair") is None and sdc_problem(alone, "off") is None


SDC = ("--attention_dropout", "0", "--save_steps", "5", "--save_total_limit", "10", "--sdc_check_steps", "5")
LAUNCH = (sys.executable, "-m", "infra.launch")  # exits with the ranks' code


def model_digests(out: Path) -> dict[int, list[str]]:
    """Each committed checkpoint's weights files' digests, by step (accelerate's model.safetensors; DeepSpeed's model
    states)."""
    found = {}
    for manifest in sorted(out.glob("checkpoints/step_*/manifest.json")):
        m = json.loads(manifest.read_text())
        weights = [name for name in sorted(m["files"]) if name == "model.safetensors" or name.endswith("model_states.pt")]
        found[m["step"]] = [m["files"][name]["xxh3_64"] for name in weights]
    return found


@pytest.fixture(scope="module")
def clean(small_data, tmp_path_factory):
    """A run without the fault, by engine config (made once each)."""
    runs: dict[tuple[str, int], Path] = {}

    def of(config: str, processes: int = 3) -> Path:
        if (config, processes) not in runs:
            tmp = tmp_path_factory.mktemp("clean")
            args = recipe_args(small_data, tmp / "out", 20, *SDC, "--report_to", "none")
            proc = run(args, tmp, {}, num_processes=processes, config=config)
            assert proc.returncode == 0, proc.stderr[-3000:]
            scope = "weights and optimizer state" if config == "cpu.yaml" else "weights"
            assert f"copies identical on all {processes} ranks: {scope}, " in proc.stdout
            runs[config, processes] = tmp / "out"
        return runs[config, processes]

    return of


@pytest.mark.slow  # 30 s each: out of the quick suite; CI runs the first after the matrix (make test-ci-slow)
@pytest.mark.parametrize(
    ("config", "what", "found", "processes"),
    [
        pytest.param("cpu.yaml", "weights", 10, 4, marks=pytest.mark.ci),
        ("cpu.yaml", "optimizer", 10, 3),
        ("zero2.yaml", "weights", 7, 3),
        ("zero2.yaml", "weights", 7, 4),
    ],
    ids=["ddp-weights-4", "ddp-optimizer-3", "zero2-weights-3", "zero2-weights-4"],
)
def test_a_flipped_bit_is_caught_never_committed_and_repaired_bit_for_bit(config, what, found, processes, clean, small_data, tmp_path):
    """Three or four processes (sums whose order the steps trained again must keep); one bit of rank 1's weights (or
    Adam moment) flipped after the update of step 7. Under DDP the
    check before the save of step 10 finds rank 1's copy apart from the others (named, with the tensor), step 10 is
    not written, the run goes back to step 5 and trains 6-10 again on the same samples: it ends bit for bit as the clean
    run, and every checkpoint it committed is the clean run's. Under ZeRO-2 the next update overwrites the weights from
    the partitions (the flip lasts one step, its gradient spread by then), so only a check at every step catches it: at
    step 7, repaired the same way."""
    out = tmp_path / "out"
    every = ("--sdc_check_steps", "1") if found == 7 else ()
    faults = {"rank": 1, "flip": {"steps": [7], "what": what}}
    proc = run(recipe_args(small_data, out, 20, *SDC, *every), tmp_path, faults, num_processes=processes, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = clean(config, processes)
    host = socket.gethostname()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sdc: copies disagree")]
    assert len(lines) == 1 and lines[0].startswith(f"sdc: copies disagree at step {found}: rank 1 on {host} differ in "), lines
    assert ("model.model.embed_tokens.weight" if what == "weights" else "model.embed_tokens.weight.exp_avg") in lines[0]
    assert f"sdc: repaired: back to step_00000005; the {found - 5} steps since are trained again" in proc.stdout
    assert_same_weights(out, reference)
    assert model_digests(out) == model_digests(reference) and sorted(model_digests(out)) == [5, 10, 15, 20]
    assert global_sequence(out, processes) == global_sequence(reference, processes)  # the steps kept: the clean run's samples

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (logged,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    assert {k: logged.data.metrics[k] for k in ("sdc/mismatches", "sdc/repairs")} == {"sdc/mismatches": 1, "sdc/repairs": 1}
    assert logged.data.metrics["sdc/checks"] >= 5 and logged.info.status == "FINISHED"


@pytest.mark.slow  # 30 s: out of the quick suite; CI runs it after the matrix (make test-ci-slow)
@pytest.mark.ci
def test_a_process_that_computes_wrong_twice_stops_the_run_at_its_newest_sound_checkpoint(clean, small_data, tmp_path):
    """Rank 1's weights flipped after the update of step 7 (repaired from step 5), then of step 12: named a second
    time at the check of step 15, the run stops at step 10, its newest checkpoint (the clean run's), with exit code 77
    and stopped.json naming rank 1, its host and the tensors. (A flip in its copy of the summed gradients is caught at
    its own step: tests/test_replay.py.)"""
    reference = clean("cpu.yaml")
    out = tmp_path / "out"
    faults = {"rank": 1, "flip": {"steps": [7, 12], "what": "weights"}}
    proc = run(recipe_args(small_data, out, 20, *SDC, "--report_to", "none"), tmp_path, faults, num_processes=3, launcher=LAUNCH)
    assert proc.returncode == SDC_EXIT_CODE, proc.stderr[-3000:]
    assert "sdc: repaired: back to step_00000005" in proc.stdout
    assert "sdc: stopping at step 10, the newest sound checkpoint (named before: a machine that computes wrong)" in proc.stdout
    record = json.loads((out / "stopped.json").read_text())
    assert record["reason"] == "sdc" and record["step"] == 10 and record["ranks"] == [1] and record["hosts"] == [socket.gethostname()]
    assert record["found_at"] == 15 and record["tensors"][0].startswith("model."), record
    digests = model_digests(out)
    assert digests == {step: d for step, d in model_digests(reference).items() if step <= 10}, digests
    assert not (out / "final").exists()
