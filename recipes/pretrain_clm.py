"""Pretrain a Llama-style causal language model on prepared token shards.

    make train                                                        # the default, on this machine
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain_clm.py \
        --config recipes/configs/pretrain_clm.yaml                   # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/pretrain_clm.py \
        --config recipes/configs/pretrain_clm.yaml                   # every GPU of one node
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/pretrain_clm.py \
        --config recipes/configs/pretrain_clm.yaml --learning_rate 3e-4

Any flag overrides the YAML. The run resumes by itself from the newest checkpoint in
`output_dir` (`--resume_from_checkpoint none` starts over) and continues the same MLflow run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from infra import (
    AttentionArguments,
    DataArguments,
    Job,
    LossOutput,
    TrainingArguments,
    causal_lm_flops,
    check_data_and_training,
    load_pretrained,
    open_data,
    parse_config,
    predicted_tokens,
    require,
    resolved,
    run_recipe,
    start,
    token_losses,
    train,
)


@dataclass
class ModelArguments(AttentionArguments):
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Load these weights (path or hub id); else build a new model from the fields below."}
    )
    hidden_size: int = field(default=128, metadata={"help": "Width of the residual stream."})
    intermediate_size: int = field(default=344, metadata={"help": "Width of the MLP."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads."})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "KV heads for grouped-query attention (default: all)."})
    attention_dropout: float = field(default=0.0, metadata={"help": "Dropout on attention probabilities."})
    document_attention: bool = field(
        default=False,
        metadata={
            "help": "Attend within each document only: position ids restart after every EOS and a document's first token "
            "is not predicted from the one before (from the same shards; any attn_implementation)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"a multiple of num_attention_heads={self.num_attention_heads}",
        )
        require(0 <= self.attention_dropout < 1, "attention_dropout", self.attention_dropout, "a number in [0, 1)")


def build_model(args: ModelArguments, tokenizer, seq_len: int):
    if args.model_name_or_path:
        hint = "pass a path or hub id of a causal LM"
        return load_pretrained(
            AutoModelForCausalLM.from_pretrained, args.model_name_or_path, hint, attn_implementation=args.attn_implementation
        )
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads or args.num_attention_heads,
        max_position_embeddings=seq_len,
        attention_dropout=args.attention_dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation)


def lm_inputs(batch: torch.Tensor, eos_token_id: int | None = None) -> dict[str, torch.Tensor | bool]:
    """The model's inputs for a batch of packed token samples. With `eos_token_id` (document_attention), position ids
    that restart after each EOS, from which transformers builds a causal mask that stays within each document, and
    labels that skip each later document's first token. Vectorised: no Python loop over the tokens."""
    if eos_token_id is None:
        return {"input_ids": batch, "labels": batch}
    starts = torch.zeros_like(batch, dtype=torch.bool)
    starts[:, 1:] = batch[:, :-1] == eos_token_id  # the token after an EOS begins a document
    index = torch.arange(batch.shape[1], device=batch.device).expand_as(batch)
    position_ids = index - torch.where(starts, index, 0).cummax(dim=1).values
    return {"input_ids": batch, "labels": batch.masked_fill(starts, -100), "position_ids": position_ids, "use_cache": False}


def lm_loss(
    model, batch: torch.Tensor, num_items_in_batch: torch.Tensor | None = None, eos_token_id: int | None = None, per_sample=False
) -> LossOutput:
    """The token loss of the batch: summed and divided by num_items_in_batch (the Trainer's), or the mean when None.
    With per_sample (a data_mixture's loss per source): also each sample's summed token loss and token count."""
    inputs = lm_inputs(batch, eos_token_id)
    out = model(**inputs, num_items_in_batch=num_items_in_batch)
    return LossOutput(out.loss, token_losses(out.logits, inputs["labels"]) if per_sample else None)


def lm_tokens(batch: torch.Tensor, eos_token_id: int | None = None) -> torch.Tensor:
    """The tokens the loss counts (the Trainer's items)."""
    return predicted_tokens(lm_inputs(batch, eos_token_id)["labels"])


def lm_eval(accelerator, model, batches, eos_token_id: int | None = None) -> dict[str, float]:
    """Mean token loss and perplexity over the held-out samples, all ranks together."""
    total = torch.zeros(2, device=accelerator.device)  # sum of token losses, tokens
    one = torch.ones((), device=accelerator.device)
    for batch in batches:
        total += torch.stack([lm_loss(model, batch, one, eos_token_id).loss.float(), lm_tokens(batch, eos_token_id).float()])
    loss_sum, tokens = accelerator.reduce(total, "sum").tolist()
    loss = loss_sum / tokens
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def main(argv: list[str] | None = None) -> int:
    # Configuration and data: everything is checked before a process group, file or run exists
    model_args, data_args, args = parse_config(
        (ModelArguments, DataArguments, TrainingArguments), argv, check=lambda m, d, a: check_data_and_training(d, a)
    )
    config = resolved(model_args, data_args, args)
    data = open_data(data_args, args)
    tokenizer = AutoTokenizer.from_pretrained(data.dataset.tokenizer_dir)
    accelerator = start(args)

    model = build_model(model_args, tokenizer, data.dataset.seq_len)
    eos = tokenizer.eos_token_id if model_args.document_attention else None  # documents end at EOS in the shards

    job = Job(
        name="pretrain_clm",
        model=model,
        data=data,
        loss=partial(lm_loss, eos_token_id=eos),
        evaluate=partial(lm_eval, eos_token_id=eos),
        processor=tokenizer,
        task="text-generation",
        unit="tokens",
        units_per_sample=data.dataset.seq_len,
        flops_per_unit=causal_lm_flops(model, data.dataset, tokenizer.eos_token_id),
        items=partial(lm_tokens, eos_token_id=eos),  # the loss is the mean per predicted token
        per_sample_losses=True,
    )
    return train(accelerator, args, data_args, config, job)


if __name__ == "__main__":
    run_recipe(main)
