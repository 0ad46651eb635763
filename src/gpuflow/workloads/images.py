"""Images as users keep them: class folders or tar shards of JPEG/PNG/WebP files.

``--data-dir`` is a class-folder tree or a folder of tar shards (``gpuflow.data.image_sources``);
files are decoded and cropped in the loader's workers (``gpuflow.data.image_batches``), or,
with ``--decode gpu``, JPEGs are decoded and cropped on the GPU
(``gpuflow.data.image_device_batches``); validation decodes on the CPU either way; and
the model, a ResNet of ``gpuflow.models.resnet``, takes the uint8 pixels and normalises them
on the device. See docs/workloads/images.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from gpuflow.data.image_batches import (
    DataIssues,
    EncodedImages,
    EvalImages,
    TrainCrops,
    collate_images,
)
from gpuflow.data.image_decoder import choose_decoder
from gpuflow.data.image_device_batches import DeviceCrops
from gpuflow.data.image_sources import scan
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.models.pixels import IMAGENET_MEAN, IMAGENET_STD, UInt8Images
from gpuflow.models.resnet import LAYOUTS, ResNet
from gpuflow.workload import Workload
from gpuflow.workloads.images_codec import images_serving

DEFAULT_IMAGE_SIZE = 224
DEFAULT_MODEL = "resnet18"
VAL_PERCENT = 10.0
EXAMPLE_ITEMS = 8
SYNTHETIC_COUNT, SYNTHETIC_CLASSES = 512, 10


def parse_model(model_size: str | None) -> tuple[str, int]:
    """``resnet18`` or ``resnet50``, optionally with a base width: ``resnet18,width=16``."""
    kind, _, rest = (model_size or DEFAULT_MODEL).partition(",")
    width = 64
    try:
        if rest:
            name, _, value = rest.partition("=")
            if name != "width":
                raise ValueError
            width = int(value)
        if kind not in LAYOUTS or width < 1:
            raise ValueError
    except ValueError:
        raise UserError(f"--model-size {model_size!r} for images: use one of "
                        f"{', '.join(LAYOUTS)}, optionally with a width "
                        "(e.g. resnet18,width=32).") from None
    return kind, width


def image_model(kind: str, width: int, classes: int, size: int) -> nn.Module:
    """The ResNet behind the uint8 input layer."""
    net = ResNet(kind, num_classes=classes, in_channels=3, image_size=size, width=width)
    return UInt8Images(net, IMAGENET_MEAN, IMAGENET_STD)


def _example(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The first images that decode, as one batch."""
    items = []
    for index in range(len(dataset)):  # type: ignore[arg-type]
        pixels, label = dataset[index]
        if pixels is not None:
            items.append((pixels, label))
        if len(items) == EXAMPLE_ITEMS:
            break
    return collate_images(items)


def _sources(data_dir: str) -> tuple[list[str], Dataset, Dataset | None]:
    """The class names and the encoded training and validation images: a packed set
    (``gpuflow data pack --workload images``), or class folders or tar shards."""
    packed = open_packed(data_dir, "images")
    if packed is not None:
        return list(packed.meta["classes"]), packed.train, packed.val
    splits = scan(data_dir, VAL_PERCENT)
    return (splits.classes, EncodedImages(splits.train),
            EncodedImages(splits.val) if splits.val else None)


def _resnet_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.net.blocks)  # type: ignore[union-attr,arg-type]


def _synthetic(size: int, seed: int, count: int = SYNTHETIC_COUNT,
               classes: int = SYNTHETIC_CLASSES) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (count, size, size, 3), dtype=torch.uint8,
                           generator=generator)
    return TensorDataset(pixels, torch.randint(0, classes, (count,), generator=generator))


def _served(kind: str, width: int, state: Mapping[str, Any]) -> Workload:
    """A trained run rebuilt for serving from its codec's saved state (class names and
    size): the model's head is as wide as in training, and no data is read, so a run is
    served where its ``--data-dir`` is not. Its few random images only fill the example
    batch a server warms up on."""
    try:
        classes, size = [str(name) for name in state["classes"]], int(state["size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"The images run's saved codec state {dict(state)!r} lacks its class "
                        f"names or size ({type(exc).__name__}: {exc}); train the run again "
                        "or serve it where its --data-dir is.") from None
    examples = _synthetic(size, 0, EXAMPLE_ITEMS, max(len(classes), 2))
    return Workload(name="images", model=image_model(kind, width, max(len(classes), 2), size),
                    train_dataset=examples, example_batch=tuple(examples.tensors),
                    repeated_blocks=_resnet_blocks, serving=images_serving(classes, size))


def build(data_dir: str | None = None, data: str = "real", model_size: str | None = None,
          image_size: int | None = None, strict_data: bool = False,
          decode: str | None = None,
          serving_state: Mapping[str, Any] | None = None) -> Workload:
    """The `images` workload: a ResNet trained on encoded image files; given a run's
    ``serving_state`` (when a server rebuilds it), built from that instead of the data."""
    kind, width = parse_model(model_size)
    if serving_state is not None:
        return _served(kind, width, serving_state)
    size = image_size or DEFAULT_IMAGE_SIZE
    if size < 8:
        raise UserError(f"--image-size {size}: images need at least 8 pixels a side.")
    if data == "synthetic":
        classes = [str(i) for i in range(SYNTHETIC_CLASSES)]
        return Workload(name="images", model=image_model(kind, width, len(classes), size),
                        train_dataset=_synthetic(size, 0), val_dataset=_synthetic(size, 1),
                        repeated_blocks=_resnet_blocks, serving=images_serving(classes, size))
    if data_dir is None:
        raise UserError("images reads --data-dir DIR: class folders (DIR/CLASS/*.jpg, or "
                        "DIR/train/CLASS and DIR/val/CLASS) or tar shards (DIR/*.tar with "
                        "classes.json). `python scripts/fashion_mnist_jpeg.py --out DIR` "
                        "writes one from Fashion-MNIST.")
    on_gpu = choose_decoder(decode) == "gpu"
    classes, train, encoded_val = _sources(data_dir)
    issues = DataIssues(strict_data)
    val = EvalImages(encoded_val, size, "RGB", issues) if encoded_val is not None else None
    if on_gpu:
        stage = DeviceCrops(size, issues)
        augment, collate, report = stage.crops, stage.collate, stage.report
    else:
        augment = TrainCrops(size, "RGB", issues)
        collate, report = partial(collate_images, issues=issues), issues.report
    return Workload(
        name="images",
        model=image_model(kind, width, max(len(classes), 2), size),
        train_dataset=train,
        val_dataset=val,
        collate_fn=collate,
        example_batch=_example(EvalImages(train, size, "RGB", DataIssues(strict_data))),
        repeated_blocks=_resnet_blocks,
        serving=images_serving(classes, size),
        augment=augment,
        data_report=report,
    )
