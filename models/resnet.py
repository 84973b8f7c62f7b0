"""ResNet-50 and ResNet-101, equal to torchvision's ``resnet50()`` / ``resnet101()``.

torchvision's CPU wheel is not available on this project's machines, so the zoo carries its own:
the same architecture (ResNet v1.5: the stride-2 convolution of a downsampling bottleneck is the
3×3 one), the same module names (``state_dict()`` keys load into torchvision's model and back),
the same parameter counts and the same initialisation rules (Kaiming-normal fan-out for
convolutions, BatchNorm weight 1 and bias 0, PyTorch's default Linear init).

>>> sum(p.numel() for p in resnet50().parameters())
25557032
>>> sum(p.numel() for p in resnet101().parameters())
44549160
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["ResNet", "Bottleneck", "resnet50", "resnet101"]


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (carrying the stride), 1×1 expand by 4, plus the shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv(cin, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
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
    linear classifier."""

    def __init__(self, blocks: Sequence[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        for i, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            stage = []
            for b in range(count):
                stage.append(Bottleneck(cin, width, stride=2 if b == 0 and i > 0 else 1))
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
