"""Every feature with every other: a pairwise covering array of real runs (`make test-matrix`, in CI after `make test`).

Eight factors, each with its values (FACTORS). covertable generates runs in which every pair of values of any two
factors meets at least once, under CONSTRAINTS (combinations that mean nothing: packed data is the SFT recipe's; LoRA is
a fine-tuning recipe's). `python -m tests.test_matrix` prints the array. Each run, on tiny data and a tiny model:

- trains, is interrupted by its fault, resumes (on the same number of processes, or on another: OTHER), and ends as an
  uninterrupted run of the same combination did: bit for bit on the same number of processes, else every logged loss
  within LOSS_TOLERANCE of it; in both cases the samples are those of the uninterrupted run, each once, in its order;
- or is refused before anything is written, in one line naming the two settings that conflict (REFUSED, also listed in
  docs/guarantees.md).

Nothing else passes: a traceback, a launch past its time limit, a half-written folder.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from infra.distributed import FSDP_ON_CPU_ENV
from infra.testing import FAULTS_ENV
from tests.conftest import BIN, REPO, launch_command, run_launch
from tests.test_pretrain import kill_all, trace

FACTORS = OrderedDict(
    engine=["ddp", "zero2", "zero3", "fsdp2"],
    data=["one_source", "mixture", "packed_sft", "document_attention"],
    lever=["none", "activation_checkpointing", "compile", "lora"],
    fault=["none", "non_finite", "sigterm", "kill9"],
    save=["sync", "async", "upload"],
    processes=[4, 2, 1],  # 4: sums of several terms, whose order a resume must keep (2 hide it: a + b)
    precision=["bf16", "fp32"],
    resume=["same", "other"],
)
CONFIG = {"ddp": "cpu.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml", "fsdp2": "fsdp.yaml"}

STEPS = 12  # per run; checkpoints every SAVE_STEPS
SAVE_STEPS = 4
STOP = 8  # where a run without a fault is stopped (max_steps) before it is resumed
SAMPLES_PER_STEP = 8  # 2 per micro-batch on every process, the accumulation 4 / processes: within the first epoch
OTHER = {4: 2, 2: 1, 1: 4}  # the number of processes a run resumes on with resume=other
LOSS_TOLERANCE = 6e-3  # relative, per step, on another number of processes (the sums' order): tests/test_elastic.py's


class Case(NamedTuple):
    engine: str
    data: str
    lever: str
    fault: str
    save: str
    processes: int
    precision: str
    resume: str

    @property
    def recipe(self) -> str:
        return "sft_clm" if self.data == "packed_sft" else "pretrain_clm"

    @property
    def name(self) -> str:
        return "-".join(str(v) for v in self)


def meaningful(values: dict) -> bool:
    """Whether values of some factors can meet in one run. LoRA is for fine-tuning: the SFT recipe here."""
    return values["lever"] != "lora" or values["data"] == "packed_sft"


# Combinations refused on purpose, before anything is written: {pair of (factor, value): what the line names}
REFUSED: dict[frozenset, tuple[str, ...]] = {
    # peft's adapters are trained under DDP or in one process; ZeRO and FSDP2 would need the adapter's own sharding
    **{
        frozenset({("lever", "lora"), ("engine", e)}): ("use_peft", n)
        for e, n in (("zero2", "DEEPSPEED"), ("zero3", "DEEPSPEED"), ("fsdp2", "FSDP"))
    },
}


def refusal(values: dict) -> tuple[str, ...] | None:
    """What the refusal line of these values names, or None."""
    for pair, names in REFUSED.items():
        if all(values.get(factor, value) == value and factor in values for factor, value in pair):
            return names
    return None


def runs_through(values: dict) -> bool:
    """CONSTRAINTS: values that make a run that trains (the pairs a refusal stops are proven by REFUSED's own runs)."""
    return meaningful(values) and refusal(values) is None


CONSTRAINTS = [{"operator": "fn", "requires": ["lever", "data", "engine"], "evaluate": runs_through}]


def covering_array() -> list[Case]:
    """covertable's greedy pairwise array of runs that train (deterministic: rows sorted by a hash of their values),
    then for each refused pair one run that holds it (the first row it can be put in)."""
    from covertable import make

    cases = [Case(**row) for row in make(FACTORS, strength=2, constraints=CONSTRAINTS)]
    refused = []
    for pair in REFUSED:
        held = (c._replace(**dict(pair)) for c in cases)
        refused.append(next(c for c in held if meaningful(c._asdict()) and c not in refused))
    return cases + refused


def uncovered(cases: list[Case]) -> list[dict]:
    """The pairs of values of two factors that no run holds (but for those no run can: LoRA with pretraining)."""
    missing = []
    for a, b in itertools.combinations(FACTORS, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            pair = {a: va, b: vb}
            ruled_out = {"lever", "data"} <= pair.keys() and not meaningful(pair)
            held = [c for c in cases if getattr(c, a) == va and getattr(c, b) == vb]
            if refusal(pair) is None:  # held by a run that trains
                held = [c for c in held if refusal(c._asdict()) is None]
            if not ruled_out and not held:
                missing.append(pair)
    return missing


def test_the_array_covers_every_pair_and_breaks_no_constraint():
    cases = covering_array()
    assert not uncovered(cases)
    assert all(meaningful(c._asdict()) for c in cases)
    assert sum(refusal(c._asdict()) is not None for c in cases) == len(REFUSED)
    assert len(set(cases)) == len(cases) < 30


# The runs


def arguments(case: Case, inputs: dict, out: Path, max_steps: int, processes: int, upload: str | None) -> list[str]:
    data = inputs["small_data"] if case.recipe == "pretrain_clm" else inputs["packed_sft"]
    args = ["--config", str(REPO / "recipes" / "configs" / f"{case.recipe}.yaml"), "--data_dir", str(data)]
    args += ["--output_dir", str(out), "--max_steps", str(max_steps), "--warmup_steps", str(2 * STEPS)]
    args += ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", str(4 // processes)]
    args += ["--logging_steps", "1", "--save_steps", str(SAVE_STEPS), "--save_total_limit", "100"]
    args += ["--trace_samples", "true", "--mixed_precision", "bf16" if case.precision == "bf16" else "no"]
    # dropout on where the resumed run must match bit for bit; off where another number of processes draws other masks
    dropout = "0.1" if case.resume == "same" else "0.0"
    if case.recipe == "pretrain_clm":
        args += ["--learning_rate", "1e-2", "--hidden_size", "64", "--intermediate_size", "128", "--attention_dropout", dropout]
        args += ["--eval_samples", "0"]
    else:  # its YAML keeps the best checkpoint by eval/loss: 8 samples held out
        args += ["--eval_samples", "8"]
        args += ["--model_name_or_path", str(inputs["sft_model" if case.resume == "same" else "sft_model_without_dropout"])]
    if case.data == "mixture":
        args += ["--data_mixture", f"name=big,data_dir={inputs['tiny_data']},weight=0.7", f"name=small,data_dir={data},weight=0.3"]
    if case.data == "document_attention":
        args += ["--document_attention", "true"]
    args += {
        "none": [],
        "activation_checkpointing": ["--gradient_checkpointing", "true"],
        "compile": ["--torch_compile", "true"],
        "lora": ["--use_peft", "true", "--lora_r", "4", "--lora_dropout", dropout],
    }[case.lever]
    if case.save == "async":
        args += ["--async_save", "true"]
    if case.save == "upload":
        args += ["--checkpoint_upload_dir", upload]
    if case.fault == "non_finite":
        args += ["--max_bad_steps", "2"]
    return args + EXTRA_ARGUMENTS


EXTRA_ARGUMENTS: list[str] = []  # every launch's (a test beside the matrix sets it)


TRANSIENT = {"steps": [2], "by": float("nan")}  # once in a process's life: a step computed again does not meet it


def replayed(case: Case) -> bool:
    """Whether the run's first launch meets a transient fault (infra.replay: every engine here)."""
    return case.fault == "non_finite"


def bad_batches(processes: int) -> list[int]:
    """Micro-batches (counted on each rank since the run began) of steps 5 and 6: two non-finite steps in a row, a
    rollback to step 4, the data since skipped."""
    per_step = 4 // processes
    return [4 * per_step + 1, 5 * per_step + 1]


def faults(case: Case, transient: bool = False, **more) -> dict[str, str]:
    """The launch's environment: FSDP on CPU asked for, and the injected faults (the run's non-finite steps, `more`).
    `transient`: with non-finite steps, also a loss made NaN once at step 2 on every process, where a step can be
    computed again (infra.replay): computed again, kept, and the run goes on as without it."""
    spec = {"nan_batches": bad_batches(case.processes)} if case.fault == "non_finite" else {}
    if transient and replayed(case):
        spec["scale_loss"] = TRANSIENT
    spec |= more
    return {FSDP_ON_CPU_ENV: "1"} | ({FAULTS_ENV: json.dumps({"rank": "all", **spec})} if spec else {})


def run(
    case: Case, inputs: dict, folder: Path, max_steps: int, processes: int, upload: str | None, env: dict
) -> subprocess.CompletedProcess:
    """A launch to max_steps, to its end (at most 7 minutes)."""
    args = arguments(case, inputs, folder / "out", max_steps, processes, upload)
    cmd, env = launch_command(CONFIG[case.engine], args, folder, recipe=case.recipe, num_processes=processes, env=env)
    return run_launch(cmd, env, timeout=420)


def interrupted(case: Case, inputs: dict, folder: Path, upload: str | None) -> tuple[subprocess.CompletedProcess, int | None]:
    """The first launch, cut by the run's fault: its result and the step the next launch must resume at."""
    if case.fault in ("none", "non_finite"):
        return run(case, inputs, folder, STOP, case.processes, upload, faults(case, transient=True)), STOP
    # SIGTERM to the launcher, or kill -9 of every process, once step 4 is committed; each micro-batch slowed so that it
    # lands before the run ends
    env = faults(case, slow_seconds=0.25)
    launcher = (str(BIN / "python"), "-m", "infra.launch") if case.fault == "sigterm" else (str(BIN / "accelerate"), "launch")
    args = arguments(case, inputs, folder / "out", STEPS, case.processes, upload)
    cmd, env = launch_command(
        CONFIG[case.engine], args, folder, recipe=case.recipe, num_processes=case.processes, env=env, launcher=launcher
    )
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "interrupted.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        committed = folder / "out" / "checkpoints" / f"step_{SAVE_STEPS:08d}" / "manifest.json"
        deadline = time.monotonic() + 300
        while not committed.exists():
            if proc.poll() is not None:  # refused, or failed: check() tells which
                return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), log.read_text()), None
            assert time.monotonic() < deadline, "timed out waiting for the first checkpoint"
            time.sleep(0.05)
        if case.fault == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        else:
            kill_all(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    if case.fault == "sigterm":
        assert "preempted (SIGTERM): saved step" in text, text[-3000:]
    saved = sorted((folder / "out" / "checkpoints").glob("step_*"))
    step = int(saved[-1].name[len("step_") :])
    assert step < STEPS, f"the run reached step {step} before its fault"
    return subprocess.CompletedProcess(cmd, 0, text, ""), step


def consumed(out: Path, processes: int, after: int = 0, through: int = 1 << 30) -> list:
    """(sample, source) of steps after..through in training order: per micro-batch, the ranks' slices in rank order."""
    lines = [[line for line in trace(out, r) if after < line["step"] <= through] for r in range(processes)]
    return [
        (i, line.get("sources", [None] * len(line["ids"]))[k])
        for step in zip(*lines, strict=True)
        for line in step
        for k, i in enumerate(line["ids"])
    ]


def losses(folder: Path) -> dict[int, float]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}


def assert_refused(proc: subprocess.CompletedProcess, out: Path, names: tuple[str, ...]) -> None:
    """Exit code 1, one line `<kind> error: ...` naming both settings, no traceback of ours (plain `accelerate launch`
    prints its own when a rank exits 1), nothing in output_dir."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-5000:]
    lines = [line for line in text.splitlines() if re.match(r"[a-z_]+ error: ", line)]
    assert len(set(lines)) == 1 and all(name in lines[0] for name in names), lines or text[-5000:]
    assert not re.search(r'File ".*/(infra|recipes)/', text), text[-5000:]
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def interrupted_and_resumed(case: Case, inputs: dict, tmp_path: Path, upload: str | None) -> tuple[int, int]:
    """The run cut by its fault, then resumed to its end: the step it resumed at and its number of processes then."""
    first, step = interrupted(case, inputs, tmp_path / "run", upload and f"{upload}/run")
    assert first.returncode == 0 and step is not None, first.stdout[-3000:] + first.stderr[-5000:]
    if case.fault == "non_finite":
        assert "rolled back to step_00000004" in first.stdout, first.stdout[-3000:]
    if replayed(case):  # step 2's NaN, once: every process named, the step computed again kept (the straight run has none)
        assert "sdc: step 2 computed again from the state before it (rank 0: loss nan" in first.stdout, first.stdout[-3000:]
        assert "computed another loss: a transient fault in its forward pass; the step computed again is kept" in first.stdout
    if case.save == "async" and case.engine != "ddp":  # said once, not silently ignored
        assert first.stdout.count("saves synchronously here (background saves: DDP or one process)") == 1
    after = case.processes if case.resume == "same" else OTHER[case.processes]
    # the bad micro-batches are behind it (counted on another number of processes they would be other ones)
    second = run(case, inputs, tmp_path / "run", STEPS, after, upload and f"{upload}/run", faults(case._replace(fault="none")))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert f"world size {after}" in second.stdout and f"resumed at step {step}" in second.stdout, second.stdout[-3000:]
    for proc in (first, second):
        assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-5000:]
    return step, after


def check(case: Case, inputs: dict, tmp_path: Path, upload: str | None) -> None:
    if names := refusal(case._asdict()):
        first, _ = interrupted(case, inputs, tmp_path / "run", upload and f"{upload}/run")
        assert_refused(first, tmp_path / "run" / "out", names)
        return
    # The uninterrupted run beside the interrupted one and its resume: a launch is mostly start-up, which leaves a core
    # idle (1.5 of 2 busy, measured); nothing compared depends on timing
    with ThreadPoolExecutor(1) as beside:
        straight = beside.submit(
            run, case, inputs, tmp_path / "straight", STEPS, case.processes, upload and f"{upload}/straight", faults(case)
        )
        step, after = interrupted_and_resumed(case, inputs, tmp_path, upload)
        straight = straight.result()
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-5000:]

    ours, reference = tmp_path / "run" / "out", tmp_path / "straight" / "out"
    order = consumed(ours, case.processes, through=step) + consumed(ours, after, after=step)
    assert len(order) == STEPS * SAMPLES_PER_STEP
    assert order == consumed(reference, case.processes)  # the uninterrupted run's samples, each once, in its order
    if case.resume == "same":
        from tests.test_recipes import assert_same_weights

        assert_same_weights(reference, ours)
    for out in (ours, reference):  # nothing half-written stays, whatever the fault cut
        assert not [p.name for p in (out / "checkpoints").iterdir() if "partial" in p.name]
    mine, theirs = losses(tmp_path / "run"), losses(tmp_path / "straight")
    assert sorted(mine) == sorted(theirs) == list(range(1, STEPS + 1))
    tolerance = 0.0 if case.resume == "same" else LOSS_TOLERANCE
    for s in theirs:
        assert mine[s] == pytest.approx(theirs[s], rel=tolerance, abs=0), f"step {s}: {mine[s]} vs {theirs[s]}"


@pytest.fixture(scope="module")
def inputs(tiny_data, small_data, sft_clm_inputs, sft_without_dropout, packed_sft) -> dict:
    model = sft_clm_inputs[1][sft_clm_inputs[1].index("--model_name_or_path") + 1]
    return {
        **{"tiny_data": tiny_data, "small_data": small_data, "packed_sft": packed_sft},
        **{"sft_model": model, "sft_model_without_dropout": sft_without_dropout[1]},
    }


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", covering_array(), ids=lambda c: c.name)
def test_each_run_of_the_matrix_resumes_as_it_ran_or_is_refused_in_one_line(case, inputs, request, tmp_path):
    upload = None
    if case.save == "upload":
        fs, bucket = request.getfixturevalue("s3")
        upload = f"s3://{bucket}"
    check(case, inputs, tmp_path, upload)


@pytest.mark.slow  # a minute: beside the matrix, not in CI
@pytest.mark.multiprocess
def test_a_compiled_run_of_several_threads_a_process_resumes_bit_for_bit_with_full_determinism(inputs, tmp_path, monkeypatch):
    """Inductor's CPU kernels scatter-add with atomics, in whatever order a process's threads meet: under ZeRO-3 in one
    process of two threads, two fp32 runs alike ended 1.2e-7 apart, every loss equal (measured on the Xeon; one thread a
    process, or the aot_eager backend, repeated bit for bit). full_determinism makes inductor use ATen's deterministic
    kernels there: the matrix's comparison of this run (not in its array) holds bit for bit."""
    monkeypatch.setattr(f"{__name__}.EXTRA_ARGUMENTS", ["--full_determinism", "true"])
    check(Case("zero3", "mixture", "compile", "kill9", "sync", 1, "fp32", "same"), inputs, tmp_path, None)


if __name__ == "__main__":
    cases = covering_array()
    width = {f: max(len(f), *(len(str(v)) for v in vals)) for f, vals in FACTORS.items()}
    print("  ".join(f.ljust(width[f]) for f in FACTORS))
    for c in cases:
        print("  ".join(str(v).ljust(width[f]) for f, v in zip(FACTORS, c, strict=True)), "  refused" if refusal(c._asdict()) else "")
    print(f"{len(cases)} runs; every pair of values of two factors in at least one")
