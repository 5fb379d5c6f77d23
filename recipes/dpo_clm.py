"""Preference optimisation (DPO) of a fine-tuned causal LM against a frozen reference, on prompt/chosen/rejected triples.

    make train RECIPE=dpo_clm                                          # the default, on this machine
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/dpo_clm.py \
        --config recipes/configs/dpo_clm.yaml                          # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/dpo_clm.py \
        --config recipes/configs/dpo_clm.yaml --model_name_or_path my/sft-model --data_dir data/mine

The data comes from `python -m infra.data.tasks --task dpo` (the chat template applied; each sample holds
the chosen chat and the rejected one, labels -100 outside the answer); by default the standard
library's docstring prompts, the real function as the chosen answer and another function as the
rejected one, and the model `make train RECIPE=sft_clm` exported. The loss is DPO's sigmoid loss
(Rafailov et al. 2023), as TRL's DPOTrainer computes it:

    -log sigmoid(beta * ((log p(chosen) - log p_ref(chosen)) - (log p(rejected) - log p_ref(rejected))))

with each log p summed over the answer's tokens, averaged over the pairs of the optimizer step. The
reference is a companion model (infra.job.Companion): the starting model again (or
`ref_model_name_or_path`), placed like the policy by the engine (sharded under ZeRO-3 and FSDP2),
never checkpointed. With `--use_peft true` the reference is the policy with its adapter disabled (no
second copy). With `--precompute_ref_log_probs true` the reference's log-probabilities of every
training pair are computed once, before the first step, and the reference is dropped.
Logged: train/rewards/{chosen,rejected,margins,accuracies} and train/logps/{chosen,rejected}.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra import (
    AttentionArguments,
    Companion,
    Data,
    DataArguments,
    Job,
    LoraArguments,
    LossOutput,
    TrainingArguments,
    causal_lm_flops,
    check_data_and_training,
    is_adapted,
    load_pretrained,
    open_data,
    parse_config,
    require,
    resolved,
    run_recipe,
    start,
    train,
    with_lora,
)
from infra.reference import with_scores

FIELDS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
REFERENCE_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")  # with precompute_ref_log_probs (infra.reference)


@dataclass
class ModelArguments(AttentionArguments, LoraArguments):
    model_name_or_path: str = field(
        default="runs/sft_clm/final", metadata={"help": "The policy to start from (an SFT model): a from_pretrained path or hub id."}
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The frozen reference model; None: model_name_or_path again (with use_peft: the policy without its adapter)."},
    )

    def __post_init__(self):
        AttentionArguments.__post_init__(self)
        LoraArguments.__post_init__(self)


@dataclass
class DPOArguments:
    beta: float = field(default=0.1, metadata={"help": "DPO's beta: how far the policy may move from the reference (larger: less)."})
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference's log-probabilities of every training pair once, before the first step, and drop the "
            "reference model (less memory and time per step; a pass over the data at each launch)."
        },
    )

    def __post_init__(self):
        require(self.beta > 0, "beta", self.beta, "a number > 0")


def check(model_args: ModelArguments, dpo_args: DPOArguments, data_args: DataArguments, args: TrainingArguments) -> None:
    check_data_and_training(data_args, args)
    if dpo_args.precompute_ref_log_probs:
        accepted = "false with a data_mixture (the reference log-probabilities are computed for one data_dir)"
        require(not data_args.data_mixture, "precompute_ref_log_probs", True, accepted)


def answer_logps(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's log-probability of its answer: the sum over the tokens whose label is not -100 (the model's own
    shift: the logits at t predict the token at t + 1), in fp32."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    token_logps = torch.gather(logits.log_softmax(-1), 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1)


def pairs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen chats then the rejected ones, as one batch (one forward pass for both, as TRL does)."""
    return torch.cat([batch["input_ids"], batch["rejected_input_ids"]]), torch.cat([batch["labels"], batch["rejected_labels"]])


class DPOLoss:
    """The sigmoid DPO loss of a micro-batch of pairs and its metrics. The reference's log-probabilities come from the
    data (computed ahead), from the reference companion, or from the policy with its adapter disabled (LoRA)."""

    def __init__(self, beta: float, reference: Companion | None):
        self.beta, self.reference = beta, reference

    def reference_logps(self, model, batch, input_ids, labels) -> torch.Tensor:
        if REFERENCE_FIELDS[0] in batch:
            return torch.cat([batch[name] for name in REFERENCE_FIELDS])
        return reference_logps(self.reference.model if self.reference else model, input_ids, labels)

    def __call__(self, model, batch: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor | None = None, per_sample=False):
        input_ids, labels = pairs(batch)
        chosen, rejected = answer_logps(model, input_ids, labels).chunk(2)
        ref_chosen, ref_rejected = self.reference_logps(model, batch, input_ids, labels).chunk(2)
        chosen_rewards, rejected_rewards = self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
        total = losses.sum() / (num_items_in_batch if num_items_in_batch is not None else len(losses))
        margins = (chosen_rewards - rejected_rewards).detach()
        metrics = {
            "rewards/chosen": chosen_rewards.detach().sum(),
            "rewards/rejected": rejected_rewards.detach().sum(),
            "rewards/margins": margins.sum(),
            "rewards/accuracies": (margins > 0).float().sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum(),
        }
        per = (losses.detach(), torch.ones_like(losses)) if per_sample else None
        return LossOutput(total, per, metrics)


def reference_logps(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference's answer_logps: `model` itself (a reference), or a LoRA policy with its adapter disabled (its base)."""
    peft = getattr(model, "module", model)  # inside a DDP wrapper
    with torch.no_grad(), peft.disable_adapter() if is_adapted(peft) else contextlib.nullcontext():
        return answer_logps(model, input_ids, labels)


def precomputed(accelerator, model, data_args: DataArguments, args: TrainingArguments, source: str, own_dir: str) -> DataArguments:
    """The data with the reference's log-probabilities of every pair as two more fields, computed once ahead by `model`
    (the reference, or a LoRA policy before its first step), whole on each rank, kept in the job's own folder (each
    replica group scores for itself: no two write one copy)."""
    model.to(accelerator.device).eval()

    def score(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with accelerator.autocast():
            return torch.stack(reference_logps(model, *pairs(batch)).chunk(2))

    key = {"reference": source, "mixed_precision": accelerator.mixed_precision, "world_size": accelerator.num_processes}
    out = Path(own_dir) / "reference_logps"
    folder = with_scores(accelerator, data_args.data_dir, out, key, score, REFERENCE_FIELDS, args.per_device_eval_batch_size)
    model.train()
    return replace(data_args, data_dir=folder)


def scored_ahead(
    accelerator, reference: Companion | None, policy, policy_source: str, data_args: DataArguments, args: TrainingArguments
) -> Callable[[str], Data]:
    """What the Trainer calls with the job's own folder, once it holds the output_dir's lock, for the data with the
    reference's log-probabilities (`precomputed`): the reference's, or the LoRA policy's without its adapter. The
    reference goes with the call."""
    held = [reference]

    def prepare(own_dir: str) -> Data:
        scorer = held.pop()
        source = scorer.source if scorer else f"{policy_source} without the adapter"
        scored = precomputed(accelerator, scorer.model if scorer else policy, data_args, args, source, own_dir)
        return open_data(scored, args, FIELDS + REFERENCE_FIELDS, "infra.reference")

    return prepare


def dpo_eval(loss: DPOLoss):
    def evaluate(accelerator, model, batches) -> dict[str, float]:
        """Loss, rewards and accuracy per pair over the held-out pairs, all ranks together."""
        names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]
        total = torch.zeros(len(names) + 2, device=accelerator.device)  # loss sum, metric sums, pairs
        for batch in batches:
            out = loss(model, batch, torch.ones((), device=accelerator.device))
            total += torch.stack([out.loss.float(), *(out.metrics[n].float() for n in names), torch.tensor(1.0 * len(batch["input_ids"]))])
        sums = accelerator.reduce(total, "sum").tolist()
        count = max(sums[-1], 1.0)
        return {"eval/loss": sums[0] / count, **{f"eval/{n}": v / count for n, v in zip(names, sums[1:-1], strict=True)}}

    return evaluate


def load_reference(model_args: ModelArguments, policy) -> Companion | None:
    """The frozen reference: None with LoRA and no other reference named (the policy without its adapter is one)."""
    if is_adapted(policy) and model_args.ref_model_name_or_path is None:
        return None
    named = model_args.ref_model_name_or_path is not None
    source = model_args.ref_model_name_or_path if named else model_args.model_name_or_path
    flag = "ref_model_name_or_path" if named else "model_name_or_path"
    hint = "the reference must be a model saved with save_pretrained, or a hub id"
    kwargs = {"attn_implementation": model_args.attn_implementation}
    model = load_pretrained(AutoModelForCausalLM.from_pretrained, source, hint, flag, **kwargs)
    return Companion(model, source)


def main(argv: list[str] | None = None) -> int:
    model_args, dpo_args, data_args, args = parse_config(
        (ModelArguments, DPOArguments, DataArguments, TrainingArguments), argv, check=check
    )
    config = resolved(model_args, dpo_args, data_args, args)
    data = open_data(data_args, args, FIELDS, "python -m infra.data.tasks --task dpo", optional=REFERENCE_FIELDS)
    tokenizer = AutoTokenizer.from_pretrained(data.dataset.tokenizer_dir)
    accelerator = start(args)

    hint = "run `make train RECIPE=sft_clm` first (it exports runs/sft_clm/final)"
    model = load_pretrained(
        AutoModelForCausalLM.from_pretrained, model_args.model_name_or_path, hint, attn_implementation=model_args.attn_implementation
    )
    model = with_lora(model, model_args, "CAUSAL_LM")
    reference = load_reference(model_args, model)
    prepare_data = None
    if dpo_args.precompute_ref_log_probs:  # the reference is needed for one pass, then dropped
        prepare_data, reference = scored_ahead(accelerator, reference, model, model_args.model_name_or_path, data_args, args), None
    loss = DPOLoss(dpo_args.beta, reference)
    companions = {"reference": reference} if reference is not None else {}

    job = Job(
        name="dpo_clm",
        model=model,
        data=data,
        loss=loss,
        evaluate=dpo_eval(loss),
        processor=tokenizer,
        task="text-generation",
        unit="tokens",  # both chats of a pair, padded: the tokens the policy processes
        units_per_sample=2 * data.dataset.seq_len,
        flops_per_unit=causal_lm_flops(model, data.dataset, tokenizer.eos_token_id),
        adapter_only=model_args.use_peft and model_args.lora_export == "adapter",
        per_sample_losses=True,
        companions=companions,
        prepare_data=prepare_data,
    )
    return train(accelerator, args, data_args, config, job)


if __name__ == "__main__":
    run_recipe(main)
