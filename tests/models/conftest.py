"""Tiny configurations of real models (built from configs, no weights downloaded) and
what the optimizers are expected to precondition in them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from singd_cuda import is_supported


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    """Tiny tensors: intra-op threads only add overhead on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class RealModel:
    """A model, a fixed batch and its loss (``loss(model, batch)``, a scalar)."""

    model: nn.Module
    batch: tuple
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def gpt2() -> RealModel:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # no dropout (here and in BERT): a resumed run replays the same steps
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to the token embedding
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    return RealModel(model, (tokens,), lambda m, b: m(b[0], labels=b[0]).loss)


def llama() -> RealModel:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    return RealModel(model, (tokens,), lambda m, b: m(b[0], labels=b[0]).loss)


def bert() -> RealModel:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (4, 12), generator=generator)
    labels = torch.randint(0, 3, (4,), generator=generator)
    return RealModel(model, (tokens, labels), lambda m, b: m(b[0], labels=b[1]).loss)


def vit() -> RealModel:
    timm = pytest.importorskip("timm")
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5
    )
    return _images(model, 16, channels_last=False)


def resnet18() -> RealModel:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=5)
    return _images(model, 32, channels_last=True)


def _images(model: nn.Module, size: int, channels_last: bool) -> RealModel:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, size, size, generator=generator)
    y = torch.randint(0, 5, (4,), generator=generator)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return RealModel(model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet18": resnet18}


def build(name: str, seed: int = 0) -> RealModel:
    torch.manual_seed(seed)
    return MODELS[name]()


def expected_split(model: nn.Module) -> tuple[set[str], set[str]]:
    """(names of the modules to precondition, names of supported modules whose weight the
    fallback trains): every matmul layer (Linear, Conv1d-3d, Hugging Face Conv1D) is
    preconditioned, an output head tied to the input embedding included (README, "What
    counts as curvature")."""
    preconditioned = {name for name, module in model.named_modules() if is_supported(module)}
    return preconditioned, set()
