"""Train an image classifier (a ViT or ResNet from `transformers`) on labelled images; reports images/s.

    make train RECIPE=image_classification                             # the default, on this machine
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/image_classification.py \
        --config recipes/configs/image_classification.yaml             # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/image_classification.py \
        --config recipes/configs/image_classification.yaml --model_name_or_path google/vit-base-patch16-224 \
        --data_dir data/my_images                                      # prepared at the model's image size

The data comes from `python -m infra.data.tasks --task image_classification`: by default
scikit-learn's bundled handwritten digits; a folder with one subfolder per label, or a hub dataset,
otherwise. Held-out accuracy and macro F1 are logged; `keep_best` with `metric_for_best_model:
eval/accuracy` keeps the best checkpoints. Any flag overrides the YAML; the run resumes by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForImageClassification, ViTImageProcessorPil

from infra import (
    AttentionArguments,
    ConfigError,
    DataArguments,
    DataError,
    Job,
    LossOutput,
    TrainingArguments,
    check_data_and_training,
    class_losses,
    evaluate_classifier,
    load_pretrained,
    open_data,
    parse_config,
    require,
    resolved,
    run_recipe,
    start,
    train,
)


@dataclass
class ModelArguments(AttentionArguments):
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Load these weights (path or hub id; a new head for the labels); else build from the fields below."}
    )
    architecture: Literal["vit", "resnet"] = field(default="vit", metadata={"help": "What to build when no weights are given."})
    hidden_size: int = field(default=64, metadata={"help": "ViT width; ResNet: the last stage's channels."})
    num_hidden_layers: int = field(default=2, metadata={"help": "ViT blocks; ResNet: stages (one block each)."})
    num_attention_heads: int = field(default=4, metadata={"help": "ViT attention heads."})
    patch_size: int = field(default=2, metadata={"help": "ViT patch size, in pixels (the image size must be a multiple)."})

    def __post_init__(self):
        super().__post_init__()
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"a multiple of num_attention_heads={self.num_attention_heads}",
        )


def build_model(args: ModelArguments, image_size: int, num_channels: int, labels: list[str]):
    names = {"id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)}}
    if args.model_name_or_path:
        hint = "pass a path or hub id of an image model"
        load = AutoModelForImageClassification.from_pretrained
        kw = {"num_labels": len(labels), "ignore_mismatched_sizes": True, "attn_implementation": args.attn_implementation, **names}
        model = load_pretrained(load, args.model_name_or_path, hint, **kw)
        check_fits_images(model, args.model_name_or_path, image_size, num_channels)
        return model
    if args.architecture == "vit":
        if image_size % args.patch_size:
            raise ConfigError(f"patch_size={args.patch_size} is not valid: expected a divisor of the data's image size {image_size}")
        config = AutoConfig.for_model(
            "vit",
            image_size=image_size,
            patch_size=args.patch_size,
            num_channels=num_channels,
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads,
            intermediate_size=4 * args.hidden_size,
            **names,
        )
    else:
        widths = [max(8, args.hidden_size >> (args.num_hidden_layers - 1 - i)) for i in range(args.num_hidden_layers)]
        config = AutoConfig.for_model(
            "resnet", num_channels=num_channels, embedding_size=widths[0], hidden_sizes=widths, depths=[1] * len(widths), **names
        )
    return AutoModelForImageClassification.from_config(config, attn_implementation=args.attn_implementation)


def check_fits_images(model, source: str, image_size: int, num_channels: int) -> None:
    """A pretrained model takes the data's images, or a DataError stops the run here, before the preflight.

    The channels are compared; the size is tried with one blank image, as many models (ConvNeXt,
    MobileNet, DINOv2, ResNet) take any size whatever their config's `image_size` says, and ViT does not.
    """
    want = getattr(model.config, "num_channels", None)
    prepare = "prepare it with python -m infra.data.tasks --task image_classification"
    if want is not None and want != num_channels:
        raise DataError(f"{source!r} takes num_channels={want} but the data holds {num_channels}: {prepare} --num_channels {want}")
    params = list(model.parameters())
    if any(p.is_meta or hasattr(p, "ds_id") for p in params):  # not materialised on this rank (FSDP/ZeRO-3 loading): rank 0 tries
        return
    training = model.training
    model.eval()  # no dropout, no batch-norm statistics updated: the run is unchanged
    try:
        with torch.no_grad():
            model(pixel_values=torch.zeros(1, num_channels, image_size, image_size, dtype=params[0].dtype))
    except Exception as err:
        size = getattr(model.config, "image_size", None)
        raise DataError(
            f"{source!r} does not take the data's {image_size}x{image_size} images ({err}): "
            + (f"{prepare} --image_size {size}" if isinstance(size, int) else "prepare it at the size the model was trained on")
        ) from None
    finally:
        model.train(training)


def processor_for(image_size: int, num_channels: int) -> ViTImageProcessorPil:
    """What `pixels` below does, as an image processor exported with the model: resize, scale to [0, 1], normalise. The
    PIL one, by name: the default asks for torchvision, which the project does not install (a warning at every import)."""
    return ViTImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * num_channels, image_std=[0.5] * num_channels
    )


def pixels(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """uint8 on disk and on the wire; normalised here, in the weights' dtype (DeepSpeed's bf16 engine casts no float inputs)."""
    dtype = next(model.parameters()).dtype
    return ((batch["pixel_values"].float() / 255 - 0.5) / 0.5).to(dtype)


def image_loss(model, batch: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor, per_sample: bool = False) -> LossOutput:
    """Cross-entropy summed over the images, divided by num_items_in_batch (the Trainer's; the items are samples). With
    per_sample (a data_mixture's loss per source): also each image's loss and a count of one."""
    out = model(pixel_values=pixels(model, batch), labels=batch["labels"])
    loss = out.loss * len(batch["labels"]) / num_items_in_batch
    return LossOutput(loss, class_losses(out.logits, batch["labels"]) if per_sample else None)


def image_eval(accelerator, model, batches) -> dict[str, float]:
    """Loss, accuracy and macro F1 over the held-out images, all ranks together."""
    outputs = ((model(pixel_values=pixels(model, b), labels=b["labels"]), b["labels"]) for b in batches)
    return evaluate_classifier(accelerator, outputs, accelerator.unwrap_model(model).config.num_labels)


def main(argv: list[str] | None = None) -> int:
    model_args, data_args, args = parse_config(
        (ModelArguments, DataArguments, TrainingArguments), argv, check=lambda m, d, a: check_data_and_training(d, a)
    )
    config = resolved(model_args, data_args, args)
    data = open_data(data_args, args, ("pixel_values", "labels"), "python -m infra.data.tasks --task image_classification")
    num_channels, image_size, _ = data.dataset.index.sample_shape
    accelerator = start(args)

    model = build_model(model_args, image_size, num_channels, data.dataset.index.labels)

    job = Job(
        name="image_classification",
        model=model,
        data=data,
        loss=image_loss,
        evaluate=image_eval,
        processor=processor_for(image_size, num_channels),
        task="image-classification",
        unit="images",
        per_sample_losses=True,
    )
    return train(accelerator, args, data_args, config, job)


if __name__ == "__main__":
    run_recipe(main)
