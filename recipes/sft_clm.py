"""Supervised fine-tuning of a pretrained causal LM on prompt/response pairs, the loss on the response only.

    make train RECIPE=sft_clm                                          # the default, on this machine
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_clm.py \
        --config recipes/configs/sft_clm.yaml                          # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/sft_clm.py \
        --config recipes/configs/sft_clm.yaml --model_name_or_path my/model --data_dir data/mine

The data comes from `python -m infra.data.tasks --task sft` (chat template applied, labels -100
outside the response; `--packing true` puts several pairs in each sample, attention within each);
by default docstring -> function pairs of the Python standard library, and the model `make train`
exported. The loss is the mean per response token of each optimizer step. `--use_peft true` trains
LoRA adapters instead of every weight (infra.lora). Any flag overrides the YAML; the run resumes by
itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra import (
    AttentionArguments,
    DataArguments,
    Job,
    LoraArguments,
    LossOutput,
    TrainingArguments,
    causal_lm_flops,
    check_data_and_training,
    load_pretrained,
    open_data,
    parse_config,
    predicted_tokens,
    resolved,
    run_recipe,
    start,
    token_losses,
    train,
    with_lora,
)


@dataclass
class ModelArguments(AttentionArguments, LoraArguments):
    model_name_or_path: str = field(
        default="runs/pretrain_tiny/final", metadata={"help": "The pretrained causal LM: a from_pretrained path or hub id."}
    )

    def __post_init__(self):
        AttentionArguments.__post_init__(self)
        LoraArguments.__post_init__(self)


def sft_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """The model's inputs. Packed data (`--packing true` when prepared) has position ids that restart at each pair:
    transformers then builds a causal mask that stays within each pair (sdpa, eager, flex) or runs varlen kernels
    (flash_attention_2), so several pairs share one sample and nothing attends across them."""
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if "position_ids" in batch:
        inputs |= {"position_ids": batch["position_ids"].long(), "use_cache": False}
    return inputs


def sft_loss(model, batch: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor | None = None, per_sample: bool = False) -> LossOutput:
    """Loss over the response tokens of the micro-batch (labels are -100 elsewhere; the model shifts them): summed and
    divided by num_items_in_batch (the Trainer's: every response token of the optimizer step counts the same), or
    the mean when None. With per_sample (a data_mixture's loss per source): also each sample's sum and token count."""
    out = model(**sft_inputs(batch), num_items_in_batch=num_items_in_batch)
    return LossOutput(out.loss, token_losses(out.logits, batch["labels"]) if per_sample else None)


def response_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return predicted_tokens(batch["labels"])


def sft_eval(accelerator, model, batches) -> dict[str, float]:
    """Loss per response token over the held-out pairs, all ranks together."""
    total = torch.zeros(2, device=accelerator.device)  # sum of token losses, response tokens
    for batch in batches:
        tokens = response_tokens(batch).float()
        total += torch.stack([sft_loss(model, batch).loss.float() * tokens, tokens])
    loss_sum, tokens = accelerator.reduce(total, "sum").tolist()
    loss = loss_sum / max(tokens, 1.0)
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def main(argv: list[str] | None = None) -> int:
    model_args, data_args, args = parse_config(
        (ModelArguments, DataArguments, TrainingArguments), argv, check=lambda m, d, a: check_data_and_training(d, a)
    )
    config = resolved(model_args, data_args, args)
    data = open_data(data_args, args, ("input_ids", "labels"), "python -m infra.data.tasks --task sft", optional=("position_ids",))
    tokenizer = AutoTokenizer.from_pretrained(data.dataset.tokenizer_dir)  # the model's, with the chat template the data was made with
    accelerator = start(args)

    hint = "run `make train` first (it exports runs/pretrain_tiny/final)"
    model = load_pretrained(
        AutoModelForCausalLM.from_pretrained, model_args.model_name_or_path, hint, attn_implementation=model_args.attn_implementation
    )
    model = with_lora(model, model_args, "CAUSAL_LM")

    job = Job(
        name="sft_clm",
        model=model,
        data=data,
        loss=sft_loss,
        evaluate=sft_eval,
        processor=tokenizer,
        task="text-generation",
        unit="tokens",  # padded sample length: the tokens the model processes, response or not
        units_per_sample=data.dataset.seq_len,
        flops_per_unit=causal_lm_flops(model, data.dataset, tokenizer.eos_token_id),
        items=response_tokens,  # the loss is the mean per response token of the whole optimizer step
        adapter_only=model_args.use_peft and model_args.lora_export == "adapter",
        per_sample_losses=True,
    )
    return train(accelerator, args, data_args, config, job)


if __name__ == "__main__":
    run_recipe(main)
