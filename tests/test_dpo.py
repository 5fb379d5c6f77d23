"""The DPO recipe: its loss, gradient and rewards are TRL's DPOTrainer's on the same triples; it resumes exactly with
its reference beside it (here under DDP, LoRA and precomputed reference log-probabilities; ZeRO-3 and FSDP2 in
tests/test_recipes.py's matrix); its metrics reach MLflow; bad input stops it in one line."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from infra.data import PackedDataset
from infra.data.tasks import TaskArguments, prepare_task
from infra.job import Companion
from recipes.dpo_clm import DPOLoss
from tests import recipe_forks
from tests.conftest import REPO, free_port, stdlib_triples, write_jsonl
from tests.test_recipes import STEPS, recipe_args, straight_then_resumed

BETA = 0.1
# measured (fp32, one process, AMD EPYC): the loss 1.7e-7 apart (relative), rewards 4e-7, log-probabilities 1e-7
# (relative), gradients 7e-8 (the largest is 0.03): the same sums in another order
TOLERANCE = {"rel": 1e-5, "abs": 1e-6}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def triples_and_model(sft_clm_inputs, tmp_path_factory):
    """Eight triples prepared by `--task dpo` (long enough: nothing cut), a tiny model without dropout, and a policy
    that differs from it (noise on every weight), so that the rewards are not all zero."""
    from transformers import AutoModelForCausalLM

    data, args = sft_clm_inputs
    root = tmp_path_factory.mktemp("dpo_trl")
    triples = [{k: v[:60] for k, v in t.items()} for t in stdlib_triples(8)]
    source = write_jsonl(root / "triples.jsonl", triples)
    prepare_task(
        TaskArguments(task="dpo", source=str(source), tokenizer=str(data / "tokenizer"), output_dir=str(root / "data"), seq_len=96)
    )
    reference = AutoModelForCausalLM.from_pretrained(args[args.index("--model_name_or_path") + 1], attention_dropout=0.0)
    policy = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return triples, root / "data", reference, policy


def trl_step(triples, tokenizer, reference, policy, tmp_path):
    """TRL's DPOTrainer on the triples as conversations: the token ids it trains on, its loss, gradients and metrics."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    chats = [
        {
            "prompt": [{"role": "user", "content": t["prompt"]}],
            "chosen": [{"role": "assistant", "content": t["chosen"]}],
            "rejected": [{"role": "assistant", "content": t["rejected"]}],
        }
        for t in triples
    ]
    config = DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=BETA, per_device_train_batch_size=len(triples), report_to="none", use_cpu=True, bf16=False
    )
    config.max_length = None  # nothing cut: the triples fit
    trainer = DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=Dataset.from_list(chats), processing_class=tokenizer)
    examples = [trainer.train_dataset[i] for i in range(len(triples))]
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    loss.backward()
    metrics = {name: trainer._metrics["train"][name][-1] for name in METRICS}
    grads = {name: p.grad for name, p in trainer.model.named_parameters()}
    return examples, loss.item(), grads, metrics


def test_the_first_step_is_trl_s(triples_and_model, tmp_path):
    """The same triples, initial model and batch: the token ids, loss, gradient and logged rewards equal TRL's (fp32)."""
    from transformers import AutoTokenizer

    triples, data, reference, policy = triples_and_model
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    examples, trl_loss, trl_grads, trl_metrics = trl_step(triples, tokenizer, copy.deepcopy(reference), copy.deepcopy(policy), tmp_path)

    dataset = PackedDataset(data)
    batch = dataset.__getitems__(list(range(len(dataset))))
    assert len(dataset) == len(triples)  # nothing skipped, so the batches hold the same pairs (in another order)
    eos = tokenizer.eos_token_id
    ours = {}
    for i in range(len(dataset)):
        for name, ids, labels in (("chosen", "input_ids", "labels"), ("rejected", "rejected_input_ids", "rejected_labels")):
            answer = batch[labels][i] != -100
            start, end = int(answer.nonzero()[0]), int(answer.nonzero()[-1]) + 1
            ours.setdefault(i, {})[name] = (batch[ids][i][:start].tolist(), batch[ids][i][start:end].tolist())
    theirs = sorted((e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples)
    assert sorted((o["chosen"][0], o["chosen"][1], o["rejected"][1]) for o in ours.values()) == theirs
    assert all(o["chosen"][0] == o["rejected"][0] for o in ours.values())  # one prompt per pair
    assert all(o[name][1][-1] == eos for o in ours.values() for name in ("chosen", "rejected"))  # whole: nothing cut

    model = copy.deepcopy(policy).train()
    out = DPOLoss(BETA, Companion(copy.deepcopy(reference).eval(), "reference"))(model, batch, torch.tensor(float(len(dataset))))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(trl_loss, **TOLERANCE)
    for name in METRICS:
        assert out.metrics[name].item() / len(dataset) == pytest.approx(trl_metrics[name], **TOLERANCE), name
    assert 0 < trl_metrics["rewards/accuracies"] < 1 and trl_metrics["rewards/margins"] != 0  # a step that can tell them apart
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, trl_grads[name], rtol=1e-4, atol=1e-7), name


def test_lora_s_reference_is_the_model_without_its_adapter(triples_and_model):
    """With use_peft and no reference named, the reference log-probabilities are the base model's: the loss equals the one
    against a separate copy of the base, and no second model is built."""
    from infra.lora import LoraArguments, with_lora

    _, data, reference, _ = triples_and_model
    dataset = PackedDataset(data)
    batch = dataset.__getitems__(list(range(len(dataset))))
    lora = LoraArguments(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    adapted = with_lora(copy.deepcopy(reference), lora, "CAUSAL_LM")
    with torch.no_grad():  # move the adapter off zero so that the policy differs from its base
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    n = torch.tensor(float(len(dataset)))
    alone = DPOLoss(BETA, None)(adapted, batch, n)
    beside = DPOLoss(BETA, Companion(copy.deepcopy(reference).eval(), "base"))(adapted, batch, n)
    assert alone.loss.item() == pytest.approx(beside.loss.item(), rel=1e-6)
    assert alone.metrics["rewards/margins"].item() != 0


@pytest.mark.multiprocess
def test_dpo_trains_logs_and_resumes_exactly(dpo_clm_inputs, tmp_path):
    """3 CPU processes (DDP): resumed == straight bit for bit, the reference in no checkpoint and named in every manifest,
    the rewards and accuracies logged at every log and eval, train/learning_rate the rate each step used."""
    a, _ = straight_then_resumed("dpo_clm", "cpu.yaml", dpo_clm_inputs, tmp_path, processes=3)
    checkpoint = a / "out" / "checkpoints" / f"step_{STEPS:08d}"
    saved, exported = load_file(checkpoint / "model.safetensors"), load_file(a / "out" / "final" / "model.safetensors")
    assert saved.keys() == exported.keys()  # the policy, once: no reference weights beside it
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["companions"] == {"reference": dpo_clm_inputs[1][1]}
    client = mlflow.MlflowClient(f"sqlite:///{a / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dpo_clm").experiment_id])
    for name in METRICS:
        assert [m.step for m in client.get_metric_history(run.info.run_id, f"train/{name}")] == list(range(2, 2 * STEPS + 1, 2)), name
    for name in ("eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [3, 6, 9, 12], name
    assert 0 <= run.data.metrics["train/rewards/accuracies"] <= 1
    rates = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/learning_rate"), key=lambda m: m.step)]
    warmup = 2 * STEPS  # recipe_args: warmup over the whole run, linear from 0
    assert rates[0] == pytest.approx(5e-5 * 1 / warmup) and rates == sorted(rates)  # step 2 trained at 1/12 of the peak


@pytest.mark.slow  # minutes with the rest: out of the quick suite (make test-slow)
@pytest.mark.multiprocess
def test_lora_dpo_with_reference_log_probs_computed_ahead_resumes_exactly(dpo_clm_inputs, tmp_path):
    """use_peft and precompute_ref_log_probs together, 2 CPU processes: the base model's log-probabilities computed once
    into a copy of the data (the resumed launch computes its own: the same), resumed == straight bit for bit."""
    extra = ("--use_peft", "true", "--lora_r", "4", "--precompute_ref_log_probs", "true", "--report_to", "none")
    a, b = straight_then_resumed("dpo_clm", "cpu.yaml", dpo_clm_inputs, tmp_path, extra)
    copies = [PackedDataset(out / "out" / "reference_logps") for out in (a, b)]
    assert len(copies[0]) == len(PackedDataset(dpo_clm_inputs[0]))
    every = list(range(len(copies[0])))
    first, second = (c.__getitems__(every) for c in copies)
    assert torch.equal(first["ref_chosen_logps"], second["ref_chosen_logps"]) and (first["ref_chosen_logps"] < 0).all()
    assert torch.equal(first["input_ids"], PackedDataset(dpo_clm_inputs[0]).__getitems__(every)["input_ids"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rejected": None}, "rejected=None for the prompt"),
        ({"chosen": ""}, "chosen='' for the prompt"),
        ("no rejected column", "'rejected' is not a column of"),
    ],
)
def test_a_triple_without_both_answers_is_refused(change, message, dpo_clm_inputs, tmp_path):
    """Preparing: one line naming the answer, exit 2, nothing written."""
    rows = stdlib_triples(6)
    if change == "no rejected column":
        rows = [{k: v for k, v in row.items() if k != "rejected"} for row in rows]
    else:
        rows[3] |= change
    source = write_jsonl(tmp_path / "triples.jsonl", rows)
    tokenizer = dpo_clm_inputs[0] / "tokenizer"
    args = ["--task", "dpo", "--source", str(source), "--tokenizer", str(tokenizer), "--output_dir", str(tmp_path / "data")]
    proc = recipe_forks.run("-m infra.data.tasks", args, env=dict(os.environ))
    errors = [line for line in proc.stderr.splitlines() if "error" in line]  # the progress bar's last state may follow it
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("prepare error: ") and message in errors[0], proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "data.partial").exists()


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (("--beta", "0"), "config error: beta=0.0 is not valid: expected a number > 0"),
        (("--ref_model_name_or_path", "/no/such/reference"), "model error: ref_model_name_or_path='/no/such/reference' is neither"),
    ],
)
def test_a_bad_beta_or_reference_stops_the_recipe_in_one_line(flags, line, dpo_clm_inputs, tmp_path):
    data, extra = dpo_clm_inputs
    out = tmp_path / "out"
    args = [*recipe_args("dpo_clm", data, out, STEPS, extra), "--report_to", "none", *flags]
    env = {"PATH": "", "HF_HUB_OFFLINE": "1"}
    proc = recipe_forks.run(REPO / "recipes" / "dpo_clm.py", args, env=env)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_reference_scores_are_written_only_under_the_output_dir_s_lock(dpo_clm_inputs, tmp_path):
    """precompute_ref_log_probs into an output_dir another job holds: refused in one line before the pass, which would
    have replaced that job's reference_logps under it."""
    from infra.lock import OutputDirLock

    data, extra = dpo_clm_inputs
    out = tmp_path / "out"
    held = OutputDirLock(out).acquire()
    args = [*recipe_args("dpo_clm", data, out, STEPS, extra), "--report_to", "none", "--precompute_ref_log_probs", "true"]
    env = {"PATH": "", "HF_HUB_OFFLINE": "1"}
    try:
        proc = recipe_forks.run(REPO / "recipes" / "dpo_clm.py", args, env=env)
    finally:
        held.release()
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("output_dir error: "), proc.stderr[-2000:]
    assert "is in use by another job" in proc.stderr and "reference scores" not in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["job.lock"]


def test_the_reference_counts_in_the_memory_estimate():
    """A frozen companion adds its weights (fp32; bf16 under DeepSpeed), sharded under ZeRO-3 and FSDP like the policy."""
    from infra.memory import Setup, Shape, estimate

    shape = Shape(parameters=1000, trainable=1000, layers=1, hidden=8, intermediate=16, heads=2, batch=1, seq_len=4)
    with_reference = Shape(**{**shape.__dict__, "companions": 1000})
    for setup, per_parameter in (
        (Setup(world_size=2), 4),
        (Setup(world_size=2, engine="zero3", bf16=True), 1),
        (Setup(engine="fsdp", world_size=4), 1),
    ):
        extra = sum(estimate(with_reference, setup).values()) - sum(estimate(shape, setup).values())
        assert extra == pytest.approx(1000 * per_parameter), setup
    assert "companions" not in estimate(shape, Setup())


def test_the_default_data_pairs_each_function_against_another():
    """stdlib triples: the chosen answer is the prompt's function, the rejected one another function."""
    from infra.data.tasks import stdlib_preferences

    triples = stdlib_preferences(limit=200)
    assert len(triples) == 200
    assert all(chosen != rejected for _, chosen, rejected in triples)
    name = triples[0][0].split("`")[1].split("(")[0]
    assert f"def {name}(" in triples[0][1] and f"def {name}(" not in triples[0][2]


@pytest.mark.slow  # 60 s: CI runs it after the matrix (make test-ci-slow)
@pytest.mark.ci
@pytest.mark.multiprocess
def test_dpo_with_reference_scores_ahead_trains_as_replica_groups_each_scoring_in_its_own_folder(dpo_clm_inputs, tmp_path):
    """DPO under fault_tolerance=replicas, two groups of one process with precompute_ref_log_probs: each group scores
    the data into its own folder (two groups writing one copy at once had raced: one's unfinished copy removed under the
    other), the copies are equal; group 1 dies after step 3 and is started again: it reads its copy instead of scoring
    again and heals from group 0. Every step is committed on the global batch, and both groups end equal, bit for bit."""
    from infra.testing import FAULTS_ENV
    from tests.test_replicas import traced_steps

    data, extra = dpo_clm_inputs
    out, port, steps = tmp_path / "out", free_port(), STEPS + 2
    args = [*recipe_args("dpo_clm", data, out, steps, extra), "--report_to", "none", "--precompute_ref_log_probs", "true"]
    args += ["--global_batch_size", "8", "--per_device_train_batch_size", "2", "--trace_samples", "--preflight", "false"]
    args += ["--fault_tolerance", "replicas", "--lighthouse", f"http://127.0.0.1:{port}", "--min_replicas", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "HF_HUB_OFFLINE": "1"}
    slow = {"rank": "all", "slow_seconds": 0.2}  # a step of at least 0.4 s: the death lands mid-run on any CPU
    lighthouse = subprocess.Popen([sys.executable, "-m", "infra.replicas", "lighthouse", "--port", str(port)], cwd=REPO)

    def start(group: int, faults: dict) -> subprocess.Popen:
        cmd = [sys.executable, str(REPO / "recipes" / "dpo_clm.py"), *args, "--replica_group_id", str(group)]
        env_ = {**env, FAULTS_ENV: json.dumps(faults)}
        return subprocess.Popen(cmd, cwd=REPO, env=env_, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        groups = [start(0, slow), start(1, {**slow, "die_at_step": 3})]
        first = groups[1].communicate(timeout=300)[0]
        groups[1] = start(1, slow)
        logs = [proc.communicate(timeout=300)[0] for proc in groups]
    finally:
        lighthouse.kill()
        lighthouse.wait(timeout=10)
    assert [proc.returncode for proc in groups] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "test fault: rank dies at step 3" in first, first[-3000:]
    copies = [PackedDataset(out / "replicas" / str(g) / "reference_logps") for g in (0, 1)]
    assert all(f"kept in {out / 'replicas' / str(g) / 'reference_logps'}" in text for g, text in ((0, logs[0]), (1, first)))
    assert f"reference scores: {out / 'replicas' / '1' / 'reference_logps'} (computed by an earlier launch)" in logs[1]
    assert re.search(r"healed from a live group to step [3-9]", logs[1]), logs[1][-3000:]
    assert not (out / "reference_logps").exists() and not list(out.glob("**/*.partial"))
    every = list(range(len(copies[0])))
    first_copy, second_copy = (c.__getitems__(every) for c in copies)
    assert all(torch.equal(first_copy[k], second_copy[k]) for k in first_copy) and (first_copy["ref_chosen_logps"] < 0).all()
    committed = traced_steps(out)
    assert list(committed) == list(range(1, steps + 1)) and all(len(ids) == 8 for ids in committed.values())
    order = [i for ids in committed.values() for i in ids]
    epoch = len(set(order)) // 8 * 8  # every training pair once an epoch, but those past its last whole global batch
    assert all(len(set(order[k : k + epoch])) == len(order[k : k + epoch]) for k in range(0, len(order), epoch)), order
    finals = [re.findall(rf"final state of step {steps} \(xxh3 (\w+)\)", log) for log in logs]
    assert finals[0] == finals[1] and len(finals[0]) == 1, finals
    assert "Traceback" not in first + logs[0] + logs[1]
