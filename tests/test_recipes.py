"""The other recipes on the same infra: their data, and each under real `accelerate launch`, resumed exactly."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from infra.data import DataError, PackedDataset
from infra.data.tasks import (
    IGNORE_INDEX,
    PLAIN_CHAT_TEMPLATE,
    TaskArguments,
    prepare_task,
    sft_fields,
    stdlib_instructions,
)
from infra.distributed import FSDP_ON_CPU_ENV
from infra.metrics import classification_scores
from tests import recipe_forks
from tests.conftest import REPO, launch, write_jsonl

STEPS = 6
AUTO_CLASS = {  # each recipe, and how its export loads
    "pretrain_clm": "AutoModelForCausalLM",
    "sft_clm": "AutoModelForCausalLM",
    "dpo_clm": "AutoModelForCausalLM",
    "finetune_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}
# In the default run; the rest are slow. The classifier under FSDP2 meets both FSDP2 failures of accelerate (ready_for_fsdp).
# DPO under ZeRO-3: its reference model sharded like the policy (infra.companions).
OFFLOAD_TOLERANCE = 1e-4  # measured: about 2e-5 after a few steps, DeepSpeedCPUAdam alone reproduces it


# Data preparation


def test_sft_labels_cover_the_response_and_nothing_else(tiny_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    tokenizer.chat_template, tokenizer.pad_token = PLAIN_CHAT_TEMPLATE, tokenizer.eos_token
    prompt, response = next(stdlib_instructions())
    fields = sft_fields(tokenizer, prompt, response, 4096)
    ids, labels = fields["input_ids"], fields["labels"]
    kept = labels != IGNORE_INDEX
    assert tokenizer.decode(ids[kept]) == response + tokenizer.eos_token  # the response and its end, exactly
    first = int(np.argmax(kept))
    assert tokenizer.decode(ids[:first]).endswith("<|assistant|>\n") and prompt in tokenizer.decode(ids[:first])
    assert (ids[first:][~kept[first:]] == tokenizer.pad_token_id).all()  # after the response, only padding
    assert sft_fields(tokenizer, prompt * 50, response, 64) is None  # no room for the response: skipped, not trained on


@pytest.mark.parametrize("seed", range(5))
def test_classification_scores_match_scikit_learn(seed):
    """Accuracy and macro F1 from the confusion matrix equal scikit-learn's from the labels, absent classes included."""
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(seed)
    truth, predicted = rng.integers(0, 4, 50), rng.integers(0, 5, 50)  # class 4 is predicted, never true
    truth[truth == 2] = 0  # class 2 is neither: it does not count
    predicted[predicted == 2] = 1
    confusion = torch.zeros(5, 5)
    confusion.index_put_((torch.from_numpy(truth), torch.from_numpy(predicted)), torch.ones(50), accumulate=True)
    scores = classification_scores(confusion)
    assert scores["eval/accuracy"] == pytest.approx(accuracy_score(truth, predicted))
    assert scores["eval/f1"] == pytest.approx(f1_score(truth, predicted, average="macro"))


# Inputs of the launch tests: small and local


@pytest.fixture(scope="session")
def finetune_classification_inputs(tmp_path_factory) -> tuple[Path, list[str]]:
    """Labelled docstrings as JSONL (string labels), MiniLM's tokenizer, and a 1-layer BERT with MiniLM's vocabulary."""
    from transformers import AutoConfig, AutoModel

    from infra.data.sources import stdlib_functions

    root = tmp_path_factory.mktemp("cls")
    rows = [
        {"text": node.name + ": " + (node.body[0].value.value if node.body else ""), "label": module.split(".")[0]}
        for module, node, _ in itertools.islice(stdlib_functions(), 240)
    ]
    data = root / "data"
    prepare_task(
        TaskArguments(task="text_classification", source=str(write_jsonl(root / "rows.jsonl", rows)), output_dir=str(data), seq_len=32)
    )
    labels = PackedDataset(data).index.labels
    assert labels == sorted({r["label"] for r in rows})
    config = AutoConfig.for_model(
        "bert", vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, pad_token_id=0
    )
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(root / "encoder")
    return data, ["--model_name_or_path", str(root / "encoder"), "--eval_samples", "32", "--keep_best", "1"]


@pytest.fixture(scope="session")
def image_classification_inputs(tmp_path_factory) -> tuple[Path, list[str]]:
    """scikit-learn's digits, as the default run has them (400 of them)."""
    data = tmp_path_factory.mktemp("digits") / "data"
    prepare_task(TaskArguments(task="image_classification", output_dir=str(data), max_examples=400, samples_per_shard=96))
    dataset = PackedDataset(data)
    assert dataset.index.sample_shape == [1, 8, 8] and dataset.index.labels == [str(d) for d in range(10)]
    return data, ["--eval_samples", "32", "--per_device_train_batch_size", "8", "--hidden_size", "32"]


@pytest.fixture(scope="session")
def pretrain_clm_inputs(small_data) -> tuple[Path, list[str]]:
    """The pretraining recipe's own launch tests are in test_pretrain.py; here it joins the DeepSpeed matrix."""
    # bf16 forced: DeepSpeed's bf16 path proven on every CPU (auto gives fp32 where bf16 is emulated)
    extra = ["--eval_samples", "16", "--hidden_size", "32", "--intermediate_size", "64", "--attention_dropout", "0.1"]
    return small_data, [*extra, "--mixed_precision", "bf16"]


def recipe_args(recipe: str, data: Path, out: Path, max_steps: int, extra: list[str]) -> list[str]:
    return [
        "--config",
        str(REPO / "recipes" / "configs" / f"{recipe}.yaml"),
        "--data_dir",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        "--warmup_steps",
        str(2 * STEPS),
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--logging_steps",
        "2",
        "--eval_steps",
        "3",
        "--save_steps",
        "3",
        "--report_to",
        "mlflow",
        *extra,
    ]


def assert_same_weights(a: Path, b: Path, tolerance: float = 0.0) -> None:
    """Bit for bit, or within `tolerance` (DeepSpeedCPUAdam's offloaded step is not bit-exact across a resume)."""
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        if tolerance:  # ZeRO-3 exports bf16: an fp32 difference of 2e-5 may round to the next bf16 value, so 2 ulps too
            rtol = 2**-7 if wa[name].dtype == torch.bfloat16 else 0.0
            assert torch.allclose(wa[name].float(), wb[name].float(), rtol=rtol, atol=tolerance), f"{name} differs beyond {tolerance}"
        else:
            assert torch.equal(wa[name], wb[name]), f"{name} differs"


def straight_then_resumed(
    recipe: str, config: str, inputs, tmp_path: Path, extra: tuple[str, ...] = (), processes: int = 2
) -> tuple[Path, Path]:
    """2N steps straight, keeping the checkpoint of step N; then a new launch resumes that checkpoint in another
    output_dir to 2N. (The checkpoint of step N is what a run stopped at N leaves: the same save.) Same weights?"""
    data, args = inputs
    a, b = tmp_path / "a", tmp_path / "b"
    args = [*args, *extra, "--save_total_limit", "100"]
    env = {FSDP_ON_CPU_ENV: "1"} if config == "fsdp.yaml" else {}  # accelerate runs FSDP on accelerators only
    straight = launch(config, recipe_args(recipe, data, a / "out", 2 * STEPS, args), a, num_processes=processes, recipe=recipe, env=env)
    assert straight.returncode == 0
    (b / "out" / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "out" / "checkpoints" / f"step_{STEPS:08d}", b / "out" / "checkpoints" / f"step_{STEPS:08d}")
    resumed_args = recipe_args(recipe, data, b / "out", 2 * STEPS, [*args, "--report_to", "none"])
    resumed = launch(config, resumed_args, b, num_processes=processes, recipe=recipe, env=env)
    assert resumed.returncode == 0 and f"resumed at step {STEPS}" in resumed.stdout
    engine = "(DEEPSPEED)" if config.startswith("zero") else "(FSDP)" if config == "fsdp.yaml" else "(MULTI_CPU)"
    assert engine in resumed.stdout
    if recipe == "dpo_clm" and not {"--use_peft", "--precompute_ref_log_probs"} & set(extra):  # its reference, placed as the policy
        (line,) = [line for line in resumed.stdout.splitlines() if line.startswith("companion reference: ")]
        assert ("sharded" in line) == (config in ("zero3.yaml", "zero3_offload.yaml", "fsdp.yaml")), line
    assert_same_weights(a / "out", b / "out", tolerance=OFFLOAD_TOLERANCE if "offload" in config else 0.0)
    import transformers

    exported = getattr(transformers, AUTO_CLASS[recipe]).from_pretrained(b / "out" / "final")  # it loads (gathered under ZeRO-3)
    assert_export_equals_final(b / "out", 2 * STEPS, tmp_path / "exported", AUTO_CLASS[recipe], lora="--use_peft" in extra)
    if config == "fsdp.yaml":  # the export is the whole model: accelerate's merge of the last checkpoint's shards, bit for bit
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(b / "out" / "checkpoints" / f"step_{2 * STEPS:08d}" / "pytorch_model_fsdp_0"), str(tmp_path / "merged"))
        merged, loaded = load_file(tmp_path / "merged" / "model.safetensors"), exported.state_dict()
        assert {name for name, _ in exported.named_parameters()} <= merged.keys() <= loaded.keys()
        assert all(torch.equal(loaded[k].to(v.dtype), v) for k, v in merged.items())
    return a, b


def assert_export_equals_final(out: Path, step: int, exported: Path, auto_class: str, lora: bool = False) -> None:
    """`python -m infra.export` of the last checkpoint: the model of the run's own final/ (in its dtype: ZeRO-3 gathers
    bf16 weights), with the same files beside it. A LoRA checkpoint holds no base model: refused."""
    import subprocess
    import sys

    import transformers

    checkpoint = out / "checkpoints" / f"step_{step:08d}"
    command = [sys.executable, "-m", "infra.export", "--checkpoint", str(checkpoint), "--output", str(exported)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    if lora:
        assert proc.returncode == 1 and "holds a LoRA adapter without its base model" in proc.stderr and not exported.exists()
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = {t.dtype for t in load_file(out / "final" / "model.safetensors").values()}  # one dtype
    load = getattr(transformers, auto_class).from_pretrained
    ours, final = load(exported).state_dict(), load(out / "final").state_dict()
    assert ours.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(ours[name].to(*saved).to(tensor.dtype), tensor), f"{name} differs from final/"
    assert {p.name for p in (out / "final").iterdir()} == {p.name for p in exported.iterdir()}


@pytest.mark.parametrize(
    ("recipe", "model"),
    [
        ("pretrain_clm", "/no/such/path"),
        ("sft_clm", "empty"),
        ("dpo_clm", "/no/such/path"),
        ("finetune_classification", "no such model"),
        ("image_classification", "empty"),
    ],
)
def test_a_model_that_cannot_be_loaded_stops_the_recipe_in_one_line(recipe, model, request, tmp_path):
    """A path that does not exist, a name that is no hub id, a folder without a model: one line, exit 1, nothing written."""
    data, extra = request.getfixturevalue(f"{recipe}_inputs")
    if model == "empty":
        (tmp_path / "empty").mkdir()
        model = str(tmp_path / "empty")
    out = tmp_path / "out"
    args = [*recipe_args(recipe, data, out, STEPS, extra), "--model_name_or_path", model, "--report_to", "none"]
    env = {"PATH": "", "HF_HUB_OFFLINE": "1"}
    proc = recipe_forks.run(REPO / "recipes" / f"{recipe}.py", args, env=env)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("model error: "), proc.stderr[-2000:]
    assert ("is neither an existing path nor a hub id" in last) == (model != str(tmp_path / "empty")), last
    assert "Traceback" not in proc.stderr and not out.exists()


def test_attention_kernels_give_the_same_model(tiny_data):
    """The pretraining model built with sdpa and with eager attention: the same outputs (fp32), the kernel as asked."""
    import sys

    from transformers import AutoTokenizer

    from infra.job import attention_of

    sys.path.insert(0, str(REPO / "recipes"))
    from pretrain_clm import ModelArguments, build_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    ids = torch.randint(0, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernel in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = build_model(ModelArguments(hidden_size=32, intermediate_size=64, attn_implementation=kernel), tokenizer, 32)
        assert attention_of(model) == kernel
        logits[kernel] = model(input_ids=ids).logits
    assert torch.allclose(logits["sdpa"], logits["eager"], atol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_document_attention_equals_the_documents_run_alone(kernel, tiny_data):
    """document_attention: the summed token loss of a packed sample equals that of its documents run one by one (fp32)."""
    import sys

    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "recipes"))
    from pretrain_clm import ModelArguments, build_model, lm_loss, lm_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    eos, one = tokenizer.eos_token_id, torch.ones(())
    torch.manual_seed(0)
    model = build_model(ModelArguments(hidden_size=32, intermediate_size=64, attn_implementation=kernel), tokenizer, 64).eval()
    words = torch.randint(0, len(tokenizer), (60,), generator=torch.Generator().manual_seed(1))
    words[words == eos] = eos + 1
    docs = [torch.cat([words[a:b], torch.tensor([eos])]) for a, b in ((0, 9), (9, 29), (29, 60))]  # 10 + 21 + 32 tokens
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        alone = sum(lm_loss(model, d[None], one).loss for d in docs)
        together = lm_loss(model, packed, one, eos_token_id=eos).loss
        across = lm_loss(model, packed, one).loss  # plain causal attention over the same sample
    assert int(lm_tokens(packed, eos)) == sum(int(lm_tokens(d[None])) for d in docs) == 60
    assert torch.allclose(together, alone, rtol=1e-5)
    assert not torch.allclose(across, alone, rtol=1e-3)  # without it, later documents see the earlier ones


# Padding-free SFT: several pairs per sample, attention within each pair


def segments(sample: dict[str, torch.Tensor]) -> list[slice]:
    """Where each packed pair lies in a sample: position ids restart at 0 at each; the padding has no labels."""
    starts = [int(i) for i in torch.nonzero(sample["position_ids"] == 0)] + [len(sample["position_ids"])]
    spans = [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
    return [span for span in spans if (sample["labels"][span] != IGNORE_INDEX).any()]


def test_packing_keeps_every_pair_once_in_fewer_samples(packed_sft):
    from collections import Counter

    from transformers import AutoTokenizer

    from infra.data.tasks import sft_pair

    packed = PackedDataset(packed_sft)
    tokenizer = AutoTokenizer.from_pretrained(packed_sft / "tokenizer")
    rows = [json.loads(line) for line in (packed_sft.parent / "pairs.jsonl").read_text().splitlines()]
    pairs = [sft_pair(tokenizer, r["prompt"], r["response"], 96) for r in rows]
    assert packed.fields == ["input_ids", "labels", "position_ids"] and len(packed) < 0.7 * len(list(filter(None, pairs)))
    want = Counter((tuple(ids), tuple(labels)) for ids, labels in filter(None, pairs))
    found = Counter()
    for i in range(len(packed)):
        sample = packed[i]
        for span in segments(sample):
            found[(tuple(sample["input_ids"][span].tolist()), tuple(sample["labels"][span].tolist()))] += 1
    assert found == want  # every pair that fits, exactly once, whole


def test_a_packed_sample_has_the_loss_of_its_pairs_run_alone(sft_without_dropout, packed_sft):
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "recipes"))
    from sft_clm import sft_loss

    model = AutoModelForCausalLM.from_pretrained(sft_without_dropout[1]).eval()
    one = torch.ones(())
    dataset = PackedDataset(packed_sft)
    for i in range(3):
        sample = dataset[i]
        spans = segments(sample)
        assert len(spans) > 1
        batch = {k: v[None].long() for k, v in sample.items()}
        with torch.no_grad():
            together = sft_loss(model, batch, one).loss
            alone = sum(sft_loss(model, {k: batch[k][:, span] for k in ("input_ids", "labels")}, one).loss for span in spans)
        assert torch.allclose(together, alone, rtol=1e-5), (i, together, alone)


@pytest.mark.multiprocess
@pytest.mark.slow  # the packing itself is tested above; exact resume, by every launch test
def test_packed_sft_trains_and_resumes_exactly(sft_clm_inputs, packed_sft, tmp_path):
    _, args = sft_clm_inputs
    straight_then_resumed("sft_clm", "cpu.yaml", (packed_sft, args), tmp_path)


# The loss of an optimizer step is the mean per response token over all its micro-batches and ranks


def sft_gradients(data: Path, model: Path, out: Path, config: str | None, batch: int, accumulation: int) -> dict:
    """The gradients and gradient norm of the first optimizer step of sft_clm (fp32, no clipping), as rank 0 saw them;
    `config` None: one plain process."""
    import subprocess
    import sys

    from infra.testing import GRADS_ENV

    args = [
        *("--config", str(REPO / "recipes" / "configs" / "sft_clm.yaml"), "--data_dir", str(data), "--output_dir", str(out / "out")),
        *(
            "--model_name_or_path",
            str(model),
            "--per_device_train_batch_size",
            str(batch),
            "--gradient_accumulation_steps",
            str(accumulation),
        ),
        *("--max_steps", "1", "--max_grad_norm", "1e9", "--mixed_precision", "no", "--eval_samples", "16", "--save_steps", "0"),
        *("--report_to", "none", "--preflight", "false", "--trace_samples", "true"),
    ]
    env = {GRADS_ENV: str(out), **({FSDP_ON_CPU_ENV: "1"} if config == "fsdp.yaml" else {})}
    out.mkdir(parents=True)
    if config is None:
        cmd = [sys.executable, str(REPO / "recipes" / "sft_clm.py"), *args]
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    else:
        proc = launch(config, args, out, recipe="sft_clm", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "step1.pt")


def by_hand(data: Path, model_dir: Path, ids: list[int], micro_batches: int) -> dict[str, torch.Tensor]:
    """The gradient of the mean response-token loss of samples `ids` cut into `micro_batches` groups: with 1 group
    the right one; with more, what averaging each group's own mean gave (the bug: short responses weigh more)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    samples = PackedDataset(data).__getitems__(ids)
    groups = np.array_split(np.arange(len(ids)), micro_batches)
    for group in groups:
        batch = {k: v[group] for k, v in samples.items()}
        (model(**batch).loss / micro_batches).backward()  # each group's mean over its own response tokens
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config", ["cpu.yaml", pytest.param("zero2.yaml", marks=pytest.mark.slow), pytest.param("fsdp.yaml", marks=pytest.mark.slow)]
)
def test_the_step_gradient_is_that_of_the_mean_token_loss_whatever_the_split(config, sft_without_dropout, tmp_path):
    """Batch 2 x accumulation 4 on 2 ranks == batch 16 in one process == the mean response-token loss by hand (fp32)."""
    data, model = sft_without_dropout
    whole = sft_gradients(data, model, tmp_path / "one", None, batch=16, accumulation=1)
    split = sft_gradients(data, model, tmp_path / "two", config, batch=2, accumulation=4)
    ids = json.loads((tmp_path / "one" / "out" / "trace" / "rank0.jsonl").read_text().splitlines()[0])["ids"]
    assert len(ids) == 16
    right, wrong = by_hand(data, model, ids, 1), by_hand(data, model, ids, 8)
    tokens = [int((PackedDataset(data).__getitems__(ids[i : i + 2])["labels"][:, 1:] != -100).sum()) for i in range(0, 16, 2)]
    assert len(set(tokens)) > 1, tokens  # response lengths differ between micro-batches: the split matters
    assert whole["grad_norm"] == pytest.approx(split["grad_norm"], rel=1e-5)
    assert whole["grad_norm"] == pytest.approx(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in right.values()]))), rel=1e-5)
    for name, grad in right.items():
        assert torch.allclose(whole["grads"][name], grad, rtol=1e-4, atol=1e-7), name
        if split["grads"]:  # DDP and FSDP: the averaged gradients (DeepSpeed has stepped and partitioned them)
            assert torch.allclose(split["grads"][name], grad, rtol=1e-4, atol=1e-7), name
    differs = any(not torch.allclose(right[n], wrong[n], rtol=1e-3, atol=1e-6) for n in right)
    assert differs  # averaging the micro-batches' own means (before this was fixed) gives another gradient


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "recipe",
    # finetune_classification resumes exactly under FSDP in the quick suite (test_recipe_under_sharding_resumes_exactly)
    ["sft_clm", pytest.param("finetune_classification", marks=pytest.mark.slow), "image_classification"],
)
def test_recipe_trains_evaluates_and_resumes_exactly(recipe, request, tmp_path):
    """3 CPU processes (where the order of a sum across processes shows): N steps then N more in a new launch == 2N
    straight, bit for bit; eval logged to one MLflow run."""
    a, _ = straight_then_resumed(recipe, "cpu.yaml", request.getfixturevalue(f"{recipe}_inputs"), tmp_path, processes=3)
    client = mlflow.MlflowClient(f"sqlite:///{a / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(recipe).experiment_id])
    assert run.data.tags["recipe"] == recipe and run.info.status == "FINISHED"
    assert run.data.tags["attn_implementation"] == "sdpa"  # transformers' default for Llama, BERT and ViT
    evals = [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")]
    assert evals == [3, 6, 9, 12]
    unit = "images" if recipe == "image_classification" else "tokens"
    assert client.get_metric_history(run.info.run_id, f"perf/{unit}_per_second")
    if recipe != "sft_clm":
        assert 0 <= run.data.metrics["eval/accuracy"] <= 1 and 0 <= run.data.metrics["eval/f1"] <= 1
        card = (a / "out" / "final" / "README.md").read_text()
        assert f"- eval/accuracy: {run.data.metrics['eval/accuracy']:.6g}" in card
    export = a / "out" / "final"
    if recipe == "image_classification":
        from PIL import Image
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        from recipes.image_classification import pixels

        model, processor = AutoModelForImageClassification.from_pretrained(export), AutoImageProcessor.from_pretrained(export)
        batch = PackedDataset(request.getfixturevalue(f"{recipe}_inputs")[0]).__getitems__([0, 1])
        exported = processor([Image.fromarray(d[0].numpy()) for d in batch["pixel_values"]], return_tensors="pt")["pixel_values"]
        assert torch.allclose(exported, pixels(model, batch), atol=1e-6)  # the exported processor does what training did
        assert model.config.id2label[3] == "3"


@pytest.mark.parametrize("recipe", ["finetune_classification", "image_classification"])
def test_a_classifier_s_loss_per_sample_is_each_sample_s_alone(recipe, request):
    """What a data_mixture's train/loss/<name> adds up: each sample's loss equals its loss in a batch of its own, and
    they sum to the batch's loss."""
    from functools import partial

    from transformers import AutoModelForSequenceClassification

    from recipes import finetune_classification, image_classification

    data, extra = request.getfixturevalue(f"{recipe}_inputs")
    dataset = PackedDataset(data)
    torch.manual_seed(0)
    if recipe == "image_classification":
        args = image_classification.ModelArguments(hidden_size=32)
        model, loss = image_classification.build_model(args, 8, 1, dataset.index.labels), image_classification.image_loss
    else:
        encoder = extra[extra.index("--model_name_or_path") + 1]
        model = AutoModelForSequenceClassification.from_pretrained(encoder, num_labels=len(dataset.index.labels))
        loss = partial(finetune_classification.text_loss, pad_id=0)
    model.eval()
    batch = dataset.__getitems__([0, 1, 2, 3])
    with torch.no_grad():
        out = loss(model, batch, torch.tensor(4.0), per_sample=True)
        total, (sums, counts) = out.loss, out.per_sample
        alone = [loss(model, {k: v[i : i + 1] for k, v in batch.items()}, torch.tensor(1.0)).loss for i in range(4)]
    assert counts.tolist() == [1.0] * 4
    assert torch.allclose(sums, torch.stack(alone), rtol=1e-5)
    assert torch.allclose(sums.sum() / 4, total, rtol=1e-5)


# DPO's reference sharded by ZeRO-3
IN_CI = {("dpo_clm", "zero3.yaml")}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("recipe", "accelerate_config"),
    [
        # minutes; the matrix runs ZeRO-2, ZeRO-3 and FSDP2 in CI (pretraining, SFT); CI runs DPO under ZeRO-3 too
        pytest.param(recipe, config, marks=[pytest.mark.slow, *([pytest.mark.ci] if (recipe, config) in IN_CI else [])])
        for recipe in AUTO_CLASS
        for config in ("zero2.yaml", "zero3.yaml", "zero3_offload.yaml", "fsdp.yaml")
    ],
)
def test_recipe_under_sharding_resumes_exactly(recipe, accelerate_config, request, tmp_path):
    """Each recipe under each ZeRO config and FSDP2 on 2 CPU processes (gloo), resumed exactly; the export whole."""
    straight_then_resumed(recipe, accelerate_config, request.getfixturevalue(f"{recipe}_inputs"), tmp_path, ("--report_to", "none"))


@pytest.mark.slow  # minutes with the rest: the matrix resumes LoRA runs bit for bit in CI (make test-slow)
@pytest.mark.multiprocess
def test_lora_checkpoints_hold_the_adapter_and_resume_exactly(sft_clm_inputs, tmp_path):
    """sft_clm with use_peft on 2 CPU processes: resumed == straight, bit for bit (merged export); each checkpoint holds the
    adapter and the optimizer state of its parameters only."""
    lora = ("--use_peft", "true", "--lora_r", "4", "--async_save", "true")  # step N is resumed from a background save
    a, _ = straight_then_resumed("sft_clm", "cpu.yaml", sft_clm_inputs, tmp_path, lora)
    for step in (STEPS, 2 * STEPS):  # written in the background, and synchronously (the last)
        checkpoint = a / "out" / "checkpoints" / f"step_{step:08d}"
        saved = load_file(checkpoint / "model.safetensors")
        assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
        optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
        assert len(optimizer["state"]) == len(saved)  # Adam moments for the adapter only


def test_an_image_folder_prepares_with_its_subfolders_as_labels(tmp_path):
    """A folder with one subfolder per label (datasets' imagefolder), resized and greyed to the asked shape."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, count in (("cat", 3), ("dog", 2)):
        (tmp_path / "photos" / label).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(tmp_path / "photos" / label / f"{i}.png")
    out = tmp_path / "data"
    prepare_task(TaskArguments(task="image_classification", source=str(tmp_path / "photos"), output_dir=str(out), image_size=16))
    dataset = PackedDataset(out)
    assert dataset.index.labels == ["cat", "dog"] and dataset.index.sample_shape == [1, 16, 16]
    batch = dataset.__getitems__(list(range(len(dataset))))
    assert sorted(batch["labels"].tolist()) == [0, 0, 0, 1, 1] and batch["pixel_values"].dtype == torch.uint8


def test_a_pretrained_image_model_must_take_the_data_s_images(tmp_path):
    """Weights for 16x16 RGB against 8x8 grey digits: one line naming the field and how to prepare the data; a ResNet takes any size."""
    from transformers import AutoConfig, AutoModelForImageClassification

    from recipes.image_classification import ModelArguments, build_model

    config = AutoConfig.for_model(
        "vit", image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    AutoModelForImageClassification.from_config(config).save_pretrained(tmp_path / "rgb16")
    args = ModelArguments(model_name_or_path=str(tmp_path / "rgb16"))
    with pytest.raises(DataError, match=r".*rgb16' takes num_channels=3 but the data holds 1: prepare .*--num_channels 3"):
        build_model(args, image_size=8, num_channels=1, labels=["a", "b"])
    with pytest.raises(DataError, match=r"does not take the data's 8x8 images \(.*\): prepare .*--image_size 16"):
        build_model(args, image_size=8, num_channels=3, labels=["a", "b"])
    assert build_model(args, image_size=16, num_channels=3, labels=["a", "b"]).config.num_labels == 2
    resnet = AutoConfig.for_model("resnet", num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1], image_size=224)
    AutoModelForImageClassification.from_config(resnet).save_pretrained(tmp_path / "resnet")  # takes any size, whatever its config says
    assert build_model(ModelArguments(model_name_or_path=str(tmp_path / "resnet")), image_size=8, num_channels=3, labels=["a", "b"])
