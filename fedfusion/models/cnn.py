"""A small image CNN with GroupNorm, as a Hugging Face model so it saves and loads like the LMs.

Why GroupNorm: batch-norm keeps running statistics that a width slice would have to share or reset
across clients of different widths (HeteroFL's "static BN"); GroupNorm normalises each group of
channels from the current input only, so a slice that keeps whole groups computes exactly the same
statistics for the channels it kept. The width unit of this CNN is therefore one GroupNorm group.

Layout: ``blocks[l]`` = Conv2d(3x3, padding 1) -> GroupNorm(groups) -> ReLU -> MaxPool(2) for every
block but the last; then global average pooling and a linear ``head`` to the classes.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutput


class FedCNNConfig(PretrainedConfig):
    """Channels per conv block, GroupNorm groups (the same count in every block), classes."""

    model_type = "fedfusion_cnn"

    def __init__(
        self, in_channels: int = 1, channels: list[int] | tuple[int, ...] = (32, 64, 128), groups: int = 8,
        num_classes: int = 10, image_size: int = 28, **kwargs,
    ) -> None:
        self.in_channels = in_channels
        self.channels = list(channels)
        self.groups = groups
        self.num_classes = num_classes
        self.image_size = image_size
        super().__init__(**kwargs)
        for c in self.channels:
            if c % groups:
                raise ValueError(f"channels: {c} is not divisible by groups={groups}")


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, groups: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm = nn.GroupNorm(groups, c_out)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.norm(self.conv(x))))


class FedCNN(PreTrainedModel):
    """GroupNorm CNN classifier: ``model(pixel_values, labels=...)`` -> ``.loss``, ``.logits``."""

    config_class = FedCNNConfig
    main_input_name = "pixel_values"

    def __init__(self, config: FedCNNConfig) -> None:
        super().__init__(config)
        ins = [config.in_channels, *config.channels[:-1]]
        last = len(config.channels) - 1
        self.blocks = nn.ModuleList(
            _Block(i, o, config.groups, pool=k < last) for k, (i, o) in enumerate(zip(ins, config.channels))
        )
        self.head = nn.Linear(config.channels[-1], config.num_classes)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.GroupNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **_) -> ImageClassifierOutput:
        x = pixel_values
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=(2, 3)))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


AutoConfig.register(FedCNNConfig.model_type, FedCNNConfig)
AutoModelForImageClassification.register(FedCNNConfig, FedCNN)
