"""Specs for the zoo's published workloads (``fakepg.zoo.WORKLOADS``): torchvision- and
transformers-equal models with the published parameter counts, their batches and losses, and
(where transformers is installed) the same outputs as transformers' own models given the same
weights. Full-size models are built on the meta device (shapes only), so the file runs in
seconds."""

from __future__ import annotations

import doctest
from typing import Any, Callable

import pytest
import torch
from torch import nn

from fakepg import zoo
from fakepg.zoo import data, language, resnet, vision

# torchvision's model table (https://pytorch.org/vision/stable/models.html, "Params"; for
# Inception-v3 its Inception_V3_Weights page: num_params 27161264, aux classifier included);
# ResNeXt-101 32x4d: timm's / Cadene's resnext101_32x4d; transformers: the models built from
# their default (bert-base-uncased, gpt2) and bert-large / gpt2-medium configurations.
PUBLISHED: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "vgg16": (vision.vgg16, 138_357_544),
    "alexnet": (vision.alexnet, 61_100_840),
    "inception_v3 (aux_logits=True)": (vision.inception_v3, 27_161_264),
    "resnext101_32x4d": (resnet.resnext101_32x4d, 44_177_704),
    "resnet50": (resnet.resnet50, 25_557_032),
    "BertModel bert-base (pooler included)": (language.bert_base, 109_482_240),
    "BertModel bert-large (pooler included)": (language.bert_large, 335_141_888),
    "GPT2Model gpt2": (language.gpt2, 124_439_808),
    "GPT2LMHeadModel gpt2 (head tied)": (lambda: language.gpt2(lm_head=True), 124_439_808),
    "GPT2Model gpt2-medium": (language.gpt2_medium, 354_823_168),
}

NEW_WORKLOADS = ["vgg16", "alexnet", "resnext101_32x4d", "inception_v3", "bert_base",
                 "bert_large", "gpt2", "gpt2_medium"]


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied parameter once


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_is_the_published_one(name: str) -> None:
    factory, expected = PUBLISHED[name]
    with torch.device("meta"):
        assert params(factory()) == expected


def test_vision_models_carry_torchvisions_module_names() -> None:
    with torch.device("meta"):
        vgg, alex, inc, rx = (vision.vgg16(), vision.alexnet(), vision.inception_v3(),
                              resnet.resnext101_32x4d())
    keys = list(vgg.state_dict())
    assert len(keys) == 32 and keys[0] == "features.0.weight" and keys[-1] == "classifier.6.bias"
    assert list(alex.state_dict())[-2:] == ["classifier.6.weight", "classifier.6.bias"]
    inc_keys = inc.state_dict()
    for key in ("Conv2d_1a_3x3.conv.weight", "Mixed_5b.branch_pool.bn.running_var",
                "Mixed_6e.branch7x7dbl_5.conv.weight", "AuxLogits.conv1.conv.weight",
                "AuxLogits.fc.bias", "Mixed_7c.branch3x3dbl_3b.bn.weight", "fc.weight"):
        assert key in inc_keys, key
    # ResNeXt's 3x3 is grouped (32 groups of 4 channels at stage 1), the shortcut as ResNet's
    block = rx.layer1[0]
    assert block.conv2.groups == 32 and block.conv2.weight.shape == (128, 4, 3, 3)
    assert block.conv3.weight.shape == (256, 128, 1, 1) and block.downsample is not None


def test_inception_returns_main_and_aux_logits_in_training_and_main_alone_in_eval() -> None:
    with torch.device("meta"):
        model = vision.inception_v3(num_classes=10)
        x = torch.empty(2, 3, 299, 299)
        out = model(x)
        assert isinstance(out, vision.InceptionOutputs)
        assert out.logits.shape == out.aux_logits.shape == (2, 10)
        assert model.eval()(x).shape == (2, 10)


def test_language_heads_are_tied_to_the_token_embedding() -> None:
    with torch.device("meta"):
        bert, gpt = language.bert_base(masked_lm=True), language.gpt2(lm_head=True)
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    assert bert.cls.predictions.decoder.bias is bert.cls.predictions.bias
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    assert bert.bert.pooler is None  # masked-LM training leaves a pooler unused under DDP


def test_bert_padding_row_stays_zero_after_the_head_is_tied() -> None:
    torch.manual_seed(0)
    c = language.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=16)
    model = language.BertForMaskedLM(c)
    assert model.bert.embeddings.word_embeddings.weight[0].abs().sum() == 0


@pytest.mark.parametrize("name", NEW_WORKLOADS)
def test_workload_is_registered_and_trains_a_step_with_every_parameter_used(name: str) -> None:
    assert name in zoo.WORKLOADS and name not in zoo.SCENARIOS
    small = {"bert_base": dict(seq_len=16), "bert_large": dict(seq_len=16),
             "gpt2": dict(seq_len=16), "gpt2_medium": dict(seq_len=16)}.get(name, {})
    sc = zoo.get(name, batch_size=2, iterations=1, **small)
    with torch.device("meta"):
        model = sc.build_model()
    loss = sc.step(model, sc.inputs(0, 1, device="meta")[0])
    assert loss.dim() == 0
    loss.backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert unused == []  # DDP needs no find_unused_parameters


def test_masked_tokens_mask_some_positions_and_label_only_those() -> None:
    (ids, labels), = data.masked_tokens(0, 1, 2, iterations=1, batch_size=4, seq_len=64,
                                        vocab=30522, mask_token=103)
    masked = labels != -100
    assert masked.any() and (ids[masked] == 103).all() and (ids[~masked] >= 1000).all()
    assert 0.05 < masked.float().mean() < 0.3
    again, = data.masked_tokens(0, 1, 2, iterations=1, batch_size=4, seq_len=64, vocab=30522,
                                mask_token=103)
    assert torch.equal(again[0], ids) and torch.equal(again[1], labels)


def test_causal_lm_loss_predicts_the_next_token() -> None:
    ids = torch.tensor([[1, 2, 3]])
    logits = torch.full((1, 3, 5), -30.0)
    logits[0, 0, 2] = logits[0, 1, 3] = 30.0  # position t predicts token t+1
    assert zoo.workloads.causal_lm_loss(logits, (ids, ids)) < 1e-6
    logits[0, 1, 3], logits[0, 1, 0] = -30.0, 30.0
    assert zoo.workloads.causal_lm_loss(logits, (ids, ids)) > 1


@pytest.mark.parametrize("module", [vision, language, resnet, zoo.workloads])
def test_docstring_examples_run(module: Any) -> None:
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0


# -- the same model as transformers' -----------------------------------------------------------

TINY_BERT = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=40)
TINY_GPT2 = dict(vocab_size=120, n_positions=40, n_embd=32, n_layer=2, n_head=4)


def hf_full_counts() -> list[tuple[nn.Module, nn.Module]]:
    T = pytest.importorskip("transformers")
    large = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                 intermediate_size=4096)
    with torch.device("meta"):
        return [(language.bert_base(), T.BertModel(T.BertConfig())),
                (language.bert_base(masked_lm=True), T.BertForMaskedLM(T.BertConfig())),
                (language.bert_large(), T.BertModel(T.BertConfig(**large))),
                (language.gpt2(), T.GPT2Model(T.GPT2Config())),
                (language.gpt2(lm_head=True), T.GPT2LMHeadModel(T.GPT2Config()))]


def test_parameter_counts_and_names_equal_transformers_models() -> None:
    for ours, theirs in hf_full_counts():
        assert params(ours) == params(theirs), type(theirs).__name__
        assert sorted(ours.state_dict()) == sorted(theirs.state_dict()), type(theirs).__name__


@pytest.mark.parametrize("kind", ["BertModel", "BertForMaskedLM", "GPT2Model",
                                  "GPT2LMHeadModel"])
def test_forward_equals_transformers_with_the_same_weights(kind: str) -> None:
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind.startswith("Bert"):
        ours = (language.BertModel(language.BertConfig(**TINY_BERT)) if kind == "BertModel"
                else language.BertForMaskedLM(language.BertConfig(**TINY_BERT)))
        theirs = getattr(T, kind)(T.BertConfig(**TINY_BERT))
    else:
        ours = (language.GPT2Model(language.GPT2Config(**TINY_GPT2)) if kind == "GPT2Model"
                else language.GPT2LMHeadModel(language.GPT2Config(**TINY_GPT2)))
        theirs = getattr(T, kind)(T.GPT2Config(**TINY_GPT2))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.eval(), theirs.eval()
    ids = torch.randint(120, (3, 17))
    with torch.no_grad():
        if kind == "BertModel":  # with padding, through the attention mask
            mask = torch.ones_like(ids)
            mask[1, 9:] = 0
            hidden, pooled = ours(ids, mask)
            ref = theirs(ids, attention_mask=mask)
            torch.testing.assert_close(hidden[mask.bool()], ref.last_hidden_state[mask.bool()],
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pooled, ref.pooler_output, rtol=1e-5, atol=1e-5)
            return
        out = ours(ids)
        ref = theirs(ids)
        ref = ref.logits if hasattr(ref, "logits") else ref.last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# -- a user's scenario: the loss takes (output, batch) ---------------------------------------------


def _script(tmp_path, loss: str) -> str:
    path = tmp_path / "mine.py"
    path.write_text(
        "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
        "from fakepg.zoo import Scenario\n\n"
        "def batches(rank, world_size):\n"
        "    g = torch.Generator().manual_seed(rank)\n"
        "    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g))]\n\n"
        f"scenario = Scenario(name='mine', model=lambda: nn.Linear(8, 2), batches=batches, "
        f"loss={loss}, iterations=1)\n")
    return str(path)


@pytest.mark.parametrize("loss", ["F.mse_loss", "lambda out, y: F.mse_loss(out, y)"])
def test_a_loss_written_for_the_target_fails_saying_it_gets_the_whole_batch(tmp_path, capsys,
                                                                            loss: str) -> None:
    from simddp.cli import main

    assert main(["whatif", _script(tmp_path, loss), "--world-size", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Scenario 'mine': loss(output, batch) raised AttributeError" in err
    assert "whole batch (here a tuple of Tensor[4, 8], Tensor[4, 2])" in err
    assert "F.mse_loss(output, batch[1])" in err


def test_a_loss_taking_the_batch_runs_and_a_tensor_batch_keeps_the_losss_own_error(
        tmp_path, capsys) -> None:
    from simddp.cli import main

    path = _script(tmp_path, "lambda out, batch: F.mse_loss(out, batch[1])")
    assert main(["whatif", path, "--world-size", "2", "--no-progress"]) == 0
    assert "ranks" in capsys.readouterr().out
    sc = zoo.Scenario("t", model=lambda: nn.Linear(2, 1), batches=lambda r, w: [torch.ones(3, 2)],
                      loss=lambda out, batch: out.no_such_method())
    with pytest.raises(AttributeError, match="no_such_method"):
        sc.step(sc.build_model(), sc.inputs(0, 1)[0])
