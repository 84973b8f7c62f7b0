"""Benchmark-sized workloads (published DDP figures), registered in ``WORKLOADS``.

Kept apart from ``SCENARIOS``: the feature suite trains every scenario, and one ResNet-50 step
costs seconds on a CPU. :func:`fakepg.zoo.get` reaches both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import data, language, llama, resnet, vision
from .scenario import Scenario, SeededBatches, cross_entropy_loss, ddp_options

__all__ = ["WORKLOADS", "resnet50", "resnet101", "resnext101_32x4d", "vgg16", "alexnet",
           "inception_v3", "bert_base", "bert_large", "gpt2", "gpt2_medium",
           "inception_loss", "masked_lm_loss", "causal_lm_loss", "llama3_8b", "llama3_70b",
           "llama3_405b", "llama3_tiny", "llama_workload"]

WORKLOADS: dict[str, Callable[..., Scenario]] = {}

_BERT_MASK_TOKEN = 103  # "[MASK]" in bert-base-uncased's and bert-large-uncased's vocabulary


def inception_loss(output: Any, batch: Any) -> Tensor:
    """Cross entropy of the main logits plus 0.4 × that of the auxiliary classifier's (the
    weight of PyTorch's fine-tuning tutorial and of the Inception-v3 paper's reference
    training); the main logits alone in eval mode."""
    if isinstance(output, Tensor):
        return F.cross_entropy(output, batch[1])
    return F.cross_entropy(output[0], batch[1]) + 0.4 * F.cross_entropy(output[1], batch[1])


def masked_lm_loss(output: Tensor, batch: Any) -> Tensor:
    """Cross entropy of the vocabulary logits at the masked positions (labels != -100)."""
    return F.cross_entropy(output.flatten(0, 1), batch[1].flatten(), ignore_index=-100)


def causal_lm_loss(output: Tensor, batch: Any) -> Tensor:
    """Cross entropy of each position's logits against the next token."""
    return F.cross_entropy(output[:, :-1].flatten(0, 1), batch[1][:, 1:].flatten())


def _image(name: str, model: Callable[..., nn.Module], batch_size: int, image_size: int,
           iterations: int, seed: int, bucket_cap_mb: float | None, what: str, *,
           loss: Callable[[Any, Any], Tensor] = cross_entropy_loss,
           features: tuple[str, ...] = ("benchmark", "buffers", "bucketing")) -> Scenario:
    """An ImageNet classifier on random batches, SGD with momentum."""
    return Scenario(
        name=name,
        model=functools.partial(model, 1000),
        batches=SeededBatches(data.images, seed, dict(
            iterations=iterations, batch_size=batch_size, image_size=image_size,
            num_classes=1000)),
        loss=loss,
        ddp_kwargs=ddp_options(bucket_cap_mb),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        iterations=iterations,
        seed=seed,
        description=f"{what} {name}, batch {batch_size}, {image_size}x{image_size}",
        features=features,
        # BatchNorm's running stats are per rank under DDP; dropout draws per rank
        reference_ok=False,
    )


def _language(name: str, model: Callable[[], nn.Module], batches: SeededBatches,
              iterations: int, seed: int, bucket_cap_mb: float | None, what: str,
              loss: Callable[[Any, Any], Tensor]) -> Scenario:
    """A transformer language model on random token batches, AdamW."""
    return Scenario(
        name=name, model=model, batches=batches, loss=loss,
        ddp_kwargs=ddp_options(bucket_cap_mb),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, weight_decay=0.01),
        iterations=iterations, seed=seed, description=what,
        features=("benchmark", "transformer", "tied", "bucketing"),
        reference_ok=False,  # dropout draws per rank
    )


def resnet50(batch_size: int = 32, image_size: int = 224, iterations: int = 3, seed: int = 0,
             bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's ResNet-50 (25.6 M parameters) on random ImageNet-shaped batches, SGD with
    momentum: the PyTorch DDP paper's benchmark model. In ``WORKLOADS``."""
    return _image("resnet50", resnet.resnet50, batch_size, image_size, iterations, seed,
                  bucket_cap_mb, "torchvision-equal")


def resnet101(batch_size: int = 32, image_size: int = 224, iterations: int = 3, seed: int = 0,
              bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's ResNet-101 (44.5 M parameters), as :func:`resnet50`. In ``WORKLOADS``."""
    return _image("resnet101", resnet.resnet101, batch_size, image_size, iterations, seed,
                  bucket_cap_mb, "torchvision-equal")


def _llama3(size: str, batch_size: int, seq_len: int, iterations: int, seed: int,
            bucket_cap_mb: float | None, attention: str = "sdpa") -> Scenario:
    return llama_workload(llama.LLAMA3_CONFIGS[size], f"llama3-{size}", batch_size=batch_size,
                          seq_len=seq_len, iterations=iterations, seed=seed,
                          bucket_cap_mb=bucket_cap_mb, attention=attention,
                          what=f"Llama 3 {size}")


def llama_workload(args: llama.LlamaArgs, name: str, *, batch_size: int = 1,
                   seq_len: int = 8192, iterations: int = 3, seed: int = 0,
                   bucket_cap_mb: float | None = None, attention: str = "sdpa",
                   what: str = "Llama-3-style") -> Scenario:
    """A Llama-3-style decoder of any shape (``args``) on random token sequences, AdamW: the
    zoo's ``llama3-*`` workloads, and shapes users give (``simddp.jobs``). ``seq_len`` beyond
    ``args.max_seq_len`` is refused."""
    # torchtitan trains with F.scaled_dot_product_attention (a fused kernel); "reference" is
    # Meta's written-out attention (LlamaArgs.attention)
    args = dataclasses.replace(args, attention=attention)
    if not 1 <= seq_len <= args.max_seq_len:
        raise ValueError(f"{name}: seq_len must be in 1..{args.max_seq_len}, got {seq_len}")
    return Scenario(
        name=name,
        model=functools.partial(llama.Llama, args),
        batches=SeededBatches(data.token_sequences, seed, dict(
            iterations=iterations, batch_size=batch_size, seq_len=seq_len,
            vocab=args.vocab_size)),
        loss=llama.lm_loss,
        ddp_kwargs=ddp_options(bucket_cap_mb),
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1),
        iterations=iterations,
        seed=seed,
        description=f"{what} decoder ({args.num_params():,} parameters), "
                    f"{batch_size} x {seq_len} tokens per rank, AdamW",
        features=("benchmark", "transformer", "bucketing", "real-size"),
    )


# Per-rank batch defaults follow torchtitan's llama3 training configs: local batch 1 of
# 8192 tokens. These sizes are meant for capture on the meta device (simddp's
# capture_workload): a real 8B step needs ~130 GB of CPU memory.
def llama3_8b(batch_size: int = 1, seq_len: int = 8192, iterations: int = 3, seed: int = 0,
              bucket_cap_mb: float | None = None,
              attention: str = "sdpa") -> Scenario:
    """Llama 3 8B (8,030,261,248 parameters; :data:`llama.LLAMA3_8B`) on random token
    sequences, AdamW, attention as one fused kernel (``F.scaled_dot_product_attention``, as
    torchtitan trains; ``attention="reference"``: Meta's written-out attention). In
    ``WORKLOADS`` as ``llama3-8b``."""
    return _llama3("8b", batch_size, seq_len, iterations, seed, bucket_cap_mb, attention)


def llama3_70b(batch_size: int = 1, seq_len: int = 8192, iterations: int = 3, seed: int = 0,
               bucket_cap_mb: float | None = None,
               attention: str = "sdpa") -> Scenario:
    """Llama 3 70B (70,553,706,496 parameters; :data:`llama.LLAMA3_70B`), as
    :func:`llama3_8b`. In ``WORKLOADS`` as ``llama3-70b``."""
    return _llama3("70b", batch_size, seq_len, iterations, seed, bucket_cap_mb, attention)


def llama3_405b(batch_size: int = 1, seq_len: int = 8192, iterations: int = 3, seed: int = 0,
                bucket_cap_mb: float | None = None,
                attention: str = "sdpa") -> Scenario:
    """Llama 3.1 405B (405,853,388,800 parameters; :data:`llama.LLAMA3_405B`), as
    :func:`llama3_8b`: for pipeline and tensor parallel what-ifs. In ``WORKLOADS`` as
    ``llama3-405b``."""
    return _llama3("405b", batch_size, seq_len, iterations, seed, bucket_cap_mb, attention)


def llama3_tiny(batch_size: int = 2, seq_len: int = 32, iterations: int = 3, seed: int = 0,
                bucket_cap_mb: float | None = None,
                attention: str = "sdpa") -> Scenario:
    """The Llama 3 architecture at test size (:data:`llama.LLAMA3_TINY`): trains on CPU in
    milliseconds. In ``WORKLOADS`` as ``llama3-tiny``."""
    return _llama3("tiny", batch_size, seq_len, iterations, seed, bucket_cap_mb, attention)


def resnext101_32x4d(batch_size: int = 32, image_size: int = 224, iterations: int = 3,
                     seed: int = 0, bucket_cap_mb: float | None = None) -> Scenario:
    """ResNeXt-101 32×4d (44.2 M parameters; :func:`.resnet.resnext101_32x4d`), as
    :func:`resnet50`. In ``WORKLOADS``."""
    return _image("resnext101_32x4d", resnet.resnext101_32x4d, batch_size, image_size,
                  iterations, seed, bucket_cap_mb, "torchvision-style")


def vgg16(batch_size: int = 32, image_size: int = 224, iterations: int = 3, seed: int = 0,
          bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's VGG-16 (138.4 M parameters, 102.8 M of them in the first classifier layer:
    one 411 MB gradient, a bucket of its own whatever the cap), as :func:`resnet50`."""
    return _image("vgg16", vision.vgg16, batch_size, image_size, iterations, seed,
                  bucket_cap_mb, "torchvision-equal", features=("benchmark", "bucketing"))


def alexnet(batch_size: int = 128, image_size: int = 224, iterations: int = 3, seed: int = 0,
            bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's AlexNet (61.1 M parameters), as :func:`resnet50`; batch 128 by default,
    the per-GPU batch of the published AlexNet throughput figures."""
    return _image("alexnet", vision.alexnet, batch_size, image_size, iterations, seed,
                  bucket_cap_mb, "torchvision-equal", features=("benchmark", "bucketing"))


def inception_v3(batch_size: int = 32, image_size: int = 299, iterations: int = 3,
                 seed: int = 0, bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's Inception-v3 with its auxiliary classifier (27.2 M parameters), 299×299
    images, loss = main + 0.4 × auxiliary cross entropy (:func:`inception_loss`)."""
    return _image("inception_v3", vision.inception_v3, batch_size, image_size, iterations,
                  seed, bucket_cap_mb, "torchvision-equal", loss=inception_loss)


def _bert(name: str, large: bool, batch_size: int, seq_len: int, iterations: int, seed: int,
          bucket_cap_mb: float | None) -> Scenario:
    batches = SeededBatches(data.masked_tokens, seed, dict(
        iterations=iterations, batch_size=batch_size, seq_len=seq_len,
        vocab=language.BertConfig.vocab_size, mask_token=_BERT_MASK_TOKEN))
    factory = language.bert_large if large else language.bert_base
    return _language(name, functools.partial(factory, masked_lm=True), batches, iterations,
                     seed, bucket_cap_mb,
                     f"HF-equal BertForMaskedLM ({name}), batch {batch_size}, {seq_len} tokens",
                     masked_lm_loss)


def bert_base(batch_size: int = 32, seq_len: int = 128, iterations: int = 3, seed: int = 0,
              bucket_cap_mb: float | None = None) -> Scenario:
    """BERT-base masked-LM pre-training (transformers' ``BertForMaskedLM``, 109.5 M
    parameters), sequences of 128 (BERT's phase 1), AdamW. In ``WORKLOADS``."""
    return _bert("bert_base", False, batch_size, seq_len, iterations, seed, bucket_cap_mb)


def bert_large(batch_size: int = 16, seq_len: int = 128, iterations: int = 3, seed: int = 0,
               bucket_cap_mb: float | None = None) -> Scenario:
    """BERT-large masked-LM pre-training (335.2 M parameters), as :func:`bert_base`."""
    return _bert("bert_large", True, batch_size, seq_len, iterations, seed, bucket_cap_mb)


def _gpt2(name: str, medium: bool, batch_size: int, seq_len: int, iterations: int, seed: int,
          bucket_cap_mb: float | None) -> Scenario:
    batches = SeededBatches(data.causal_tokens, seed, dict(
        iterations=iterations, batch_size=batch_size, seq_len=seq_len,
        vocab=language.GPT2Config.vocab_size))
    factory = language.gpt2_medium if medium else language.gpt2
    return _language(name, functools.partial(factory, lm_head=True), batches, iterations, seed,
                     bucket_cap_mb,
                     f"HF-equal GPT2LMHeadModel ({name}), batch {batch_size}, {seq_len} tokens",
                     causal_lm_loss)


def gpt2(batch_size: int = 8, seq_len: int = 1024, iterations: int = 3, seed: int = 0,
         bucket_cap_mb: float | None = None) -> Scenario:
    """GPT-2 small language-model training (transformers' ``GPT2LMHeadModel``, 124.4 M
    parameters, the head tied to the token embedding), 1024-token sequences, AdamW."""
    return _gpt2("gpt2", False, batch_size, seq_len, iterations, seed, bucket_cap_mb)


def gpt2_medium(batch_size: int = 4, seq_len: int = 1024, iterations: int = 3, seed: int = 0,
                bucket_cap_mb: float | None = None) -> Scenario:
    """GPT-2 medium (354.8 M parameters), as :func:`gpt2`."""
    return _gpt2("gpt2_medium", True, batch_size, seq_len, iterations, seed, bucket_cap_mb)


WORKLOADS.update(resnet50=resnet50, resnet101=resnet101, resnext101_32x4d=resnext101_32x4d,
                 vgg16=vgg16, alexnet=alexnet, inception_v3=inception_v3, bert_base=bert_base,
                 bert_large=bert_large, gpt2=gpt2, gpt2_medium=gpt2_medium)
WORKLOADS.update({"llama3-8b": llama3_8b, "llama3-70b": llama3_70b,
                  "llama3-405b": llama3_405b, "llama3-tiny": llama3_tiny})
