"""A suspicious step computed again (infra.replay): a process's transient fault told from the data, named, and the step
computed again kept, so that the run goes on bit for bit as a run without the fault; a process named twice stops it."""

from __future__ import annotations

import json
import socket
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from infra.config import ConfigError
from infra.replay import WARMUP, Attempt, Passes, Replays, Verdict, float_bits, judged, replay_problem, suspicion
from infra.sdc import SdcConfig, exact_halves, whole
from infra.stopped import SDC_EXIT_CODE
from tests.test_health import run
from tests.test_pretrain import assert_same_weights, global_sequence, recipe_args
from tests.test_sdc import model_digests

LAUNCH = (sys.executable, "-m", "infra.launch")  # exits with the ranks' code
# dropout on: the step computed again draws the same random numbers as the first attempt, or it would differ everywhere
REPLAY = ("--attention_dropout", "0.1", "--save_steps", "5", "--save_total_limit", "10")


def pair(loss: tuple[float, float], grads: tuple[int, int] = (7, 7), suspect: tuple[bool, bool] = (True, False)) -> tuple:
    """A process's two attempts at a step: its losses, the bits of its gradients, whether each looked suspicious."""
    return tuple(Attempt(float_bits(loss[i]), grads[i], False, suspect[i], loss[i], 12.0 if i == 0 else 0.5) for i in (0, 1))


def test_a_step_no_longer_suspicious_names_the_process_whose_result_changed_and_one_suspicious_again_is_the_data():
    same = pair((3.5, 3.5), suspect=(False, False))
    named, finding = judged([same, pair((3500.0, 3.5), (7, 8)), same])
    assert named == [1] and finding.startswith("rank 1 computed another loss: a transient fault in its forward pass")
    assert finding.endswith("; the step computed again is kept")
    # its copy of the summed gradients alone changed: named (the others' copies of the same sum did not change)
    named, finding = judged([same, pair((3.5, 3.5), (9, 7)), same])
    assert named == [1] and "rank 1 got other gradients from the same loss: a transient fault after its passes" in finding
    # every copy of the summed gradients changed and no loss: a backward pass, which the sum hides: nobody named
    named, finding = judged([pair((3.5, 3.5), (7, 8)), pair((3.5, 3.5), (7, 8))])
    assert named == [] and "not told apart" in finding and "step computed again is kept" in finding
    # a loss that differs in its last bits only (a GPU's kernels) is the same loss
    named, _ = judged([pair((3.5, 3.5 * (1 + 1e-6)), (7, 8)), pair((3.5, 3.5), (7, 8))])
    assert named == []
    # suspicious again (a spike or a non-finite value the data gives): nobody named, whatever changed
    again = pair((float("nan"), float("nan")), (7, 8), suspect=(True, True))
    assert judged([same, again]) == ([], "suspicious again: the data or the model, not the machine")
    assert judged([pair((3.5, 3.5), (7, 8))])[0] == [0]  # a process alone: its own
    # the line names what each suspicious process saw in its first attempt
    assert suspicion([same, pair((3.5, 3.5), suspect=(True, False))]) == "rank 1: loss 3.5, gradient norm 12"
    flat = pair((3.5, 2.0))[0].flat()
    assert Attempt.of(flat) == pair((3.5, 2.0))[0] and Attempt.of(Attempt(1, 2, True, False, 1.5, None).flat()).norm is None


def test_a_second_opinion_names_a_suspect_whose_loss_another_device_computed_differently_and_nothing_else():
    """Replays.second_opinion: a suspect's own loss (its second attempt) against the next process's computation of its
    micro-batches. Another loss there, not suspicious there: a machine wrong every time, named twice, the step not
    taken; the same loss (the last bits aside), or another that is itself non-finite or a spike: the data."""
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, scaler=None, num_processes=3)

    def opinion(losses: list[float], views: list[float], suspects: list[int], kept: float | None = 2.0):
        replays = Replays(plain, "auto", 10.0, "none", Counter())
        for _ in range(WARMUP if kept is not None else 0):
            replays.kept(Passes(torch.tensor(kept), None, None))
        verdict = Verdict(12, [], "suspicious again: the data or the model, not the machine", False, "", suspects, losses)
        return replays, replays.second_opinion(verdict, views)

    replays, verdict = opinion([2.1, 2100.0, 2.0], [2.1, 2.2, 2.0], [0, 1, 2])
    assert verdict.named == [1] and verdict.withdrawn and replays.twice == [1] and replays.named[1] == 2
    told = "rank 2 computed rank 1's micro-batches to loss 2.2, rank 1 to 2100 twice"
    assert verdict.finding == f"{told}: rank 1 computes wrong every time; the step is not taken"
    assert replays.counts["sdc/second_opinions"] == 1
    for losses, views in (
        ([2.1, 2100.0, 2.0], [2.1, 2100.0 * (1 + 1e-6), 2.0]),  # alike but for the last bits: the data
        ([2.1, float("nan"), 2.0], [2.1, float("nan"), 2.0]),  # NaN on both devices: the data
        ([2.1, 2100.0, 2.0], [2.1, 900.0, 2.0]),  # another loss, but a spike there too: not told apart, the data
    ):
        replays, verdict = opinion(losses, views, [1])
        assert verdict.named == [] and not verdict.withdrawn and not replays.twice, (losses, views)
        assert verdict.finding.startswith("suspicious again: the data or the model, not the machine (rank 2 computed rank 1's")
    # a non-finite loss on one device and a finite one on the other, before any step was kept (no spike measured yet)
    _, verdict = opinion([float("nan"), 2.0, 2.0], [2.0, 2.0, 2.0], [0], kept=None)
    assert verdict.named == [0] and verdict.withdrawn and "rank 1 computed rank 0's micro-batches to loss 2" in verdict.finding
    # a suspect through the summed gradients' norm alone (its own loss computed alike elsewhere): nobody
    _, verdict = opinion([2.1, 2.0, 2.0], [2.1, 2.0, 2.0], [0, 1, 2])
    assert verdict.named == [] and not verdict.withdrawn


def test_copies_of_the_summed_gradients_apart_name_the_process_that_changed_or_that_is_apart_again():
    """DDP: every process's copy of the summed gradients must be the same; a digest apart makes the step suspicious."""
    same = pair((3.5, 3.5), suspect=(False, False))
    # rank 1's copy apart, then the same as the others': a transient fault after its passes, named
    named, finding = judged([same, pair((3.5, 3.5), (9, 7), suspect=(False, False)), same], copies=True)
    assert named == [1] and "rank 1 got other gradients from the same loss: a transient fault after its passes" in finding
    assert suspicion([same, pair((3.5, 3.5), (9, 7)), same], copies=True).startswith("rank 1: summed gradients apart from the others'")
    # apart again, from the same state and samples: a machine that computes wrong every time (two processes: both)
    named, finding = judged([same, pair((3.5, 3.5), (9, 9), suspect=(False, False)), same], copies=True)
    assert named == [1] and finding.startswith("rank 1 summed other gradients than the others again")
    assert judged([same, pair((3.5, 3.5), (9, 9))], copies=True)[0] == [0, 1]
    # without copies (FSDP's shards, one process) digests are not compared across processes
    assert judged([same, pair((3.5, 3.5), (9, 9), suspect=(False, False))], copies=False)[0] == []
    # the digest travels in the step's float64 MAX all-reduce as two exact halves and their negations
    for value in (0, -1, 1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0, -0x0FED_CBA9_8765_4321):
        halves = exact_halves(torch.tensor(value, dtype=torch.int64))
        high, low = (int(h) for h in halves)
        assert high * 2**32 + low == value and 0 <= low < 2**32 and int(whole(halves)) == value


def test_a_spike_is_over_factor_times_the_largest_of_the_last_kept_steps_after_a_warmup():
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, scaler=None, num_processes=2)
    replays = Replays(plain, "auto", 10.0, "none", Counter())
    t = torch.tensor
    assert replays.active and replays.spike(t(1e6), t(1e6)) is None  # nothing to measure against yet
    for i in range(WARMUP):
        replays.kept(Passes(t(2.0 - i % 2), None, t(1.0 + i % 2)))
    assert replays.spike(t(19.9), t(19.9)) == 0  # under 10x the largest loss (2) and gradient norm (2)
    assert replays.spike(t(20.1), t(1.0)) == 1 and replays.spike(t(-20.1), None) == 1 and replays.spike(t(1.0), t(20.1)) == 1
    replays.kept(Passes(t(float("nan")), None, t(float("inf"))))  # a non-finite step's values are not kept
    assert replays.spike(t(1.0), t(20.1)) == 1
    # fp16: the loss scaler's overflows give infinite norms that are no spike; the loss is still looked at
    scaled = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, scaler=object(), num_processes=2)
    fp16 = Replays(scaled, "auto", 10.0, "none", Counter())
    for _ in range(WARMUP):
        fp16.kept(Passes(t(2.0), None, t(1.0)))
    assert fp16.spike(t(1.0), t(float("inf"))) == 0 and fp16.spike(t(30.0), t(1.0)) == 1
    assert Replays(plain, "auto", 0.0, "none", Counter()).spike(t(1e9), t(1e9)) is None  # factor 0: no spike check

    # where a step cannot be computed again: auto is off, `on` refused in one line
    def deepspeed_zero(stage: int, precision: str = "no") -> SimpleNamespace:
        state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage))
        return SimpleNamespace(
            distributed_type=DistributedType.DEEPSPEED, scaler=None, num_processes=2, state=state, mixed_precision=precision
        )

    deepspeed, zero = deepspeed_zero(0), deepspeed_zero(2)  # ZeRO's step waits for the loop (infra.zero_step)
    assert not Replays(deepspeed, "auto", 10.0, "none", Counter()).active and Replays(zero, "auto", 10.0, "none", Counter()).active
    assert not Replays(plain, "auto", 10.0, "replicas", Counter()).active
    # DDP's processes hold copies of the summed gradients, compared at each step; DeepSpeed's and one process's not
    assert Replays(plain, "auto", 10.0, "none", Counter()).copies and not Replays(zero, "on", 10.0, "none", Counter()).copies
    # DeepSpeed's fp16: its own loss scaler skips an overflow inside the engine's step (no accelerate scaler)
    assert (
        Replays(deepspeed_zero(2, "fp16"), "auto", 10.0, "none", Counter()).fp16 and not Replays(zero, "auto", 10.0, "none", Counter()).fp16
    )
    alone = SimpleNamespace(distributed_type=DistributedType.NO, scaler=None, num_processes=1)
    assert Replays(alone, "auto", 10.0, "none", Counter()).active and not Replays(alone, "auto", 10.0, "none", Counter()).copies
    assert replay_problem(deepspeed, "on", "none") == (
        "sdc_replay='on' is not valid under DeepSpeed without ZeRO (zero_stage 0), whose engine steps inside the backward "
        "pass; expected auto or off"
    )
    assert replay_problem(zero, "on", "none") is None
    assert replay_problem(plain, "on", "replicas").startswith("sdc_replay='on' is not valid under fault_tolerance=replicas")
    assert replay_problem(deepspeed, "auto", "none") is None and replay_problem(plain, "on", "none") is None
    with pytest.raises(ConfigError, match=r"^sdc_spike_factor=0\.5 is not valid: expected 0 \(no spike check\) or a number > 1$"):
        SdcConfig(sdc_spike_factor=0.5)


@pytest.fixture(scope="module")
def clean(small_data, tmp_path_factory):
    """Three processes under DDP, 20 steps, dropout on, no fault."""
    tmp = tmp_path_factory.mktemp("clean")
    proc = run(recipe_args(small_data, tmp / "out", 20, *REPLAY, "--report_to", "none"), tmp, {}, num_processes=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no false alarm: a spike of the training itself (this tiny model's, at a learning rate of 1e-2) is computed again,
    # suspicious again, and nobody is named
    assert "a transient fault" not in proc.stdout
    return tmp / "out"


@pytest.mark.slow  # 35 s: out of the quick suite; CI runs it after the matrix (make test-ci-slow)
@pytest.mark.ci
def test_transient_faults_are_computed_again_named_and_kept_out_and_a_second_stops_the_run(clean, small_data, tmp_path):
    """Rank 1 of three: a mantissa bit of its copy of the summed gradient flipped at step 12 (no spike: its digest apart
    from the others' copies of the same sum makes the step suspicious), then its loss multiplied by 1000 at step 16 (a
    forward pass that miscomputes: a spike). Step 12 is computed again
    from the state before it: rank 1 named (its gradients changed, the others' did not), the second attempt kept, so the
    checkpoint of step 15 is the clean run's bit for bit, with the clean run's samples. Step 16: computed again, rank 1
    named for its loss, a second time: the run saves step 16 (computed again: sound) and stops with 77, stopped.json
    naming rank 1 and its host."""
    out = tmp_path / "out"
    faults = {"rank": 1, "flip": {"steps": [12], "what": "gradient", "bit": 20}, "scale_loss": {"steps": [16], "by": 1000}}
    proc = run(recipe_args(small_data, out, 20, *REPLAY), tmp_path, faults, num_processes=3, launcher=LAUNCH)
    assert proc.returncode == SDC_EXIT_CODE, proc.stderr[-3000:]
    host = socket.gethostname()
    lines = [line for line in proc.stdout.splitlines() if "computed again from the state before it" in line and "rank 1 is on" in line]
    assert len(lines) == 2, proc.stdout[-3000:]
    assert lines[0].startswith(
        "sdc: step 12 computed again from the state before it (rank 1: summed gradients apart from the others'): rank 1 got "
        "other gradients from the same loss: a transient fault after its passes; the step computed again is kept"
    ), lines[0]
    assert lines[0].endswith(f"; rank 1 is on {host}")
    # every process saw the spike of step 16 in the summed gradients; rank 1 alone its own loss of 1000 times more
    assert lines[1].startswith("sdc: step 16 computed again from the state before it (rank 0: loss ") and "; rank 1: loss 5" in lines[1]
    assert "rank 1 computed another loss: a transient fault in its forward pass" in lines[1]
    assert "sdc: rank 1 named a second time: a machine that computes wrong" in proc.stdout
    record = json.loads((out / "stopped.json").read_text())
    assert record["reason"] == "sdc" and record["step"] == 16 and record["ranks"] == [1] and record["hosts"] == [host], record
    digests = model_digests(out)
    assert sorted(digests) == [5, 10, 15, 16]
    assert {s: d for s, d in digests.items() if s <= 15} == {s: d for s, d in model_digests(clean).items() if s <= 15}
    reference = global_sequence(clean, 3)
    assert global_sequence(out, 3)[: len(reference) * 15 // 20] == reference[: len(reference) * 15 // 20]

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (logged,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
    assert logged.data.metrics["sdc/transient_faults"] == 2 and logged.data.metrics["sdc/replays"] >= 2
    assert logged.data.metrics["goodput/repair_seconds"] > 0


@pytest.mark.slow  # 40 s each: out of the quick suite; CI runs ZeRO-2's after the matrix (make test-ci-slow)
@pytest.mark.parametrize("config", ["fsdp.yaml", pytest.param("zero2.yaml", marks=pytest.mark.ci), "zero3.yaml"])
def test_a_transient_fault_under_a_sharded_engine_is_computed_again_and_the_run_ends_as_a_clean_run(config, small_data, tmp_path):
    """FSDP2, ZeRO-2 and ZeRO-3 (no process holds another's copy of the summed gradients: replay is their check; under
    ZeRO the engine's step waits for the loop, infra.zero_step): rank 1's loss times 1000 at step 12 (of two
    micro-batches a step: the first's gradients reduced already when the step is judged), computed again, rank 1 named,
    the run ends with the clean run's weights bit for bit. Three processes: the reduce-scatters' sums of three terms
    computed again in the order they were the first time."""
    runs = {}
    for name, faults in (("clean", {}), ("faulty", {"rank": 1, "scale_loss": {"steps": [12], "by": 1000}})):
        out = tmp_path / name
        args = recipe_args(small_data, out, 16, *REPLAY, "--report_to", "none")
        proc = run(args, tmp_path, faults, config=config, num_processes=3)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (out, proc.stdout)
    assert "a transient fault" not in runs["clean"][1]
    assert "sdc: step 12 computed again from the state before it (rank 0: loss " in runs["faulty"][1]
    assert "rank 1 computed another loss: a transient fault in its forward pass" in runs["faulty"][1]
    assert_same_weights(runs["faulty"][0], runs["clean"][0])


@pytest.mark.slow  # 40 s each: out of the quick suite; CI runs DDP's after the matrix (make test-ci-slow)
@pytest.mark.parametrize(
    "config",
    [pytest.param("cpu.yaml", marks=pytest.mark.ci), "fsdp.yaml", "zero2.yaml", "zero3.yaml"],
    ids=["ddp", "fsdp2", "zero2", "zero3"],
)
def test_a_machine_wrong_every_time_is_told_from_the_data_by_another_process_and_left_out(config, small_data, tmp_path):
    """DDP, FSDP2, ZeRO-2 and ZeRO-3 (its step not taken: ZeRO's reduced gradients dropped, infra.zero_step). Rank 1 of
    two computes its first micro-batch of step 12 a thousand times too large at every attempt (a device
    wrong every time, which a replay on the same device cannot tell from the data). Computed again: suspicious again;
    rank 0 computes rank 1's micro-batches from rank 1's random state (the same samples, weights and dropout) and gets
    the ordinary loss: rank 1 named, step 12 not taken, the run saves and stops with 77, stopped.json naming rank 1;
    the checkpoint of step 12 holds the weights of a clean run of 11 steps, bit for bit. (The other way, the data: every
    launch of the suite meets real spikes of its tiny model, computed again and seen alike by another process; the
    conftest fails any that names a process nobody made faulty.)"""
    clean = tmp_path / "clean"
    proc = run(recipe_args(small_data, clean, 11, *REPLAY, "--report_to", "none"), tmp_path, {}, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "faulty"
    faults = {"rank": 1, "scale_loss": {"steps": [12], "by": 1000, "every": True}}
    proc = run(recipe_args(small_data, out, 16, *REPLAY, "--report_to", "none"), tmp_path, faults, config=config, launcher=LAUNCH)
    assert proc.returncode == SDC_EXIT_CODE, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("sdc: step 12 computed again")]
    assert "; rank 0 computed rank 1's micro-batches to loss " in line or ": rank 0 computed rank 1's" in line, line
    assert line.endswith(f"rank 1 computes wrong every time; the step is not taken; rank 1 is on {socket.gethostname()}"), line
    record = json.loads((out / "stopped.json").read_text())
    assert record["reason"] == "sdc" and record["step"] == 12 and record["ranks"] == [1], record
    assert model_digests(out)[12] == model_digests(clean)[11]


@pytest.mark.slow  # 50 s each: out of the quick suite; CI runs FSDP2's after the matrix (make test-ci-slow)
@pytest.mark.parametrize("config", [pytest.param("fsdp.yaml", marks=pytest.mark.ci), "zero3.yaml"], ids=["fsdp2", "zero3"])
def test_a_step_computed_again_and_given_a_second_opinion_changes_nothing_after_it(config, small_data, tmp_path):
    """The data's spike: rank 1's first micro-batch of step 13 has a loss 1000 times too large wherever it is computed.
    With sdc_replay on, step 13 is computed again, suspicious again, and rank 0 computes rank 1's micro-batches to the
    same loss (the data, not the machine): the step is kept. With sdc_replay off it is simply taken. The runs go on to
    step 16 and end with the same weights bit for bit: the passes computed again and the second opinion's forward
    passes leave nothing behind (found: FSDP2 kept its root unit's parameters gathered after those forwards, which have
    no backward, so every later step computed with the values from before step 13's update; now resharded)."""
    outs = {}
    for replay in ("auto", "off"):
        out = tmp_path / replay / "out"
        args = recipe_args(small_data, out, 16, "--attention_dropout", "0.1", "--report_to", "none", "--sdc_replay", replay)
        proc = run(args, tmp_path / replay, {"rank": 1, "spike_batches": {"batches": [25], "by": 1000}}, config=config)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[replay] = (out, proc.stdout)
    line = next(line for line in outs["auto"][1].splitlines() if line.startswith("sdc: step 13 computed again"))
    assert "suspicious again: the data or the model, not the machine (" in line, line
    assert "rank 0 computed rank 1's micro-batches alike" in line and "computes wrong" not in line, line
    assert_same_weights(outs["auto"][0], outs["off"][0])
