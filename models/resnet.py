"""ResNet-50, ResNet-101 and ResNeXt-101-32x4d, equal to torchvision's ``resnet50()`` /
``resnet101()`` and to its ``ResNet(Bottleneck, [3, 4, 23, 3], groups=32, width_per_group=4)``.

torchvision's CPU wheel is not available on this project's machines, so the zoo carries its own:
the same architecture (ResNet v1.5: the stride-2 convolution of a downsampling bottleneck is the
3×3 one), the same module names (``state_dict()`` keys load into torchvision's model and back),
the same parameter counts and the same initialisation rules (Kaiming-normal fan-out for
convolutions, BatchNorm weight 1 and bias 0, PyTorch's default Linear init).

>>> sum(p.numel() for p in resnet50().parameters())
25557032
>>> sum(p.numel() for p in resnet101().parameters())
44549160
>>> import torch
>>> with torch.device("meta"):  # shapes only: counting needs no memory or init time
...     sum(p.numel() for p in resnext101_32x4d().parameters())
44177704
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["ResNet", "Bottleneck", "resnet50", "resnet101", "resnext101_32x4d"]


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (carrying the stride; grouped in ResNeXt), 1×1 expand to 4 × ``planes``,
    plus the shortcut. The inner width is torchvision's ``planes * width_per_group / 64 *
    groups`` (ResNet: ``planes``; ResNeXt-32x4d: 2 × ``planes``)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, groups: int = 1,
                 width_per_group: int = 64) -> None:
        super().__init__()
        cout = planes * self.expansion
        width = int(planes * (width_per_group / 64.0)) * groups
        self.conv1 = _conv(cin, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, cout, 1)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        # A projection shortcut where the shape changes, named as torchvision names it.
        self.downsample = (nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """Stem (7×7/2 conv, BN, ReLU, 3×3/2 max-pool), four stages of bottlenecks (widths 64, 128,
    256, 512; the first block of stages 2–4 halves the resolution), global average pool, and a
    linear classifier. ``groups`` and ``width_per_group`` make it a ResNeXt (torchvision's
    arguments of the same names)."""

    def __init__(self, blocks: Sequence[int], num_classes: int = 1000, groups: int = 1,
                 width_per_group: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        for i, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            stage = []
            for b in range(count):
                stage.append(Bottleneck(cin, width, stride=2 if b == 0 and i > 0 else 1,
                                        groups=groups, width_per_group=width_per_group))
                cin = width * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet50(num_classes: int = 1000) -> ResNet:
    """torchvision's ``resnet50()`` (25,557,032 parameters with 1000 classes)."""
    return ResNet((3, 4, 6, 3), num_classes)


def resnet101(num_classes: int = 1000) -> ResNet:
    """torchvision's ``resnet101()`` (44,549,160 parameters with 1000 classes)."""
    return ResNet((3, 4, 23, 3), num_classes)


def resnext101_32x4d(num_classes: int = 1000) -> ResNet:
    """ResNeXt-101 32×4d (Xie et al. 2017, "Aggregated Residual Transformations for Deep Neural
    Networks", Table 1's 101-layer 32×4d): torchvision's ``ResNet(Bottleneck, [3, 4, 23, 3],
    groups=32, width_per_group=4)`` — 44,177,704 parameters with 1000 classes, the figure of
    timm's / Cadene's ``resnext101_32x4d``. (torchvision itself ships 32×8d and 64×4d only.)"""
    return ResNet((3, 4, 23, 3), num_classes, groups=32, width_per_group=4)
