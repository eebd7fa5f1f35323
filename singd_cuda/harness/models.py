"""The models the harness trains and measures.

* :class:`MNIST1DMLP` and :class:`MNIST1DCNN` - the MLP and CNN of the MNIST-1D paper
  (Greydanus & Kobak, arXiv 2011.14439; ``MLPBase`` and ``ConvBase`` of its repository).
* :class:`DigitsCNN` - a small CNN with BatchNorm for the 8x8 digits task.
* :class:`PatchViT` - a small vision transformer over flattened patches (linear patch
  embedding, learned positions, pre-LN blocks, mean pooling) for the ``digits_vit`` task.
* :class:`GPT` - a decoder-only transformer (token and position embeddings, causal
  self-attention, LayerNorm, MLP); the character LM task uses a small config and
  :func:`gpt_tiny` a larger one.
* :class:`HFCausalLM` - a Hugging Face causal LM (LLaMA) built from a config (nothing
  downloaded), returning its logits; the ``llama_lm`` task uses :func:`llama_small`.
* :func:`resnet18` (CIFAR-style), :func:`vit_tiny` and :func:`gpt_tiny` - the standard
  architectures of the ``memory`` sub-command.

All weight layers are ``nn.Linear`` or ``nn.Conv2d`` (which the second-order optimizers
precondition); embeddings, norms and free parameters fall back to their built-in AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MNIST1DMLP(nn.Module):
    """MNIST-1D's ``MLPBase``: 40 -> 100, a residual 100 -> 100 ReLU layer, -> 10.

    Input (N, 40) float; output (N, 10) logits.
    """

    def __init__(self, length: int = 40, hidden: int = 100, classes: int = 10) -> None:
        super().__init__()
        self.linear1 = nn.Linear(length, hidden)
        self.linear2 = nn.Linear(hidden, hidden)
        self.linear3 = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x).relu()
        h = h + self.linear2(h).relu()
        return self.linear3(h)


class MNIST1DCNN(nn.Module):
    """MNIST-1D's ``ConvBase``: three ReLU convolutions (25 channels; kernels 5, 3, 3;
    stride 2; padding 1), then a linear classifier on the flattened 25 x 5 features.

    The 1-D convolutions are ``nn.Conv2d`` with (1, k) kernels on a (N, 1, 1, 40) view,
    the same function and parameter count, so the optimizers precondition them.
    Input (N, 40) float; output (N, 10) logits.
    """

    def __init__(self, length: int = 40, channels: int = 25, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, (1, 5), stride=(1, 2), padding=(0, 1))
        self.conv2 = nn.Conv2d(channels, channels, (1, 3), stride=(1, 2), padding=(0, 1))
        self.conv3 = nn.Conv2d(channels, channels, (1, 3), stride=(1, 2), padding=(0, 1))
        out = length
        for kernel in (5, 3, 3):
            out = (out + 2 - kernel) // 2 + 1
        self.linear = nn.Linear(channels * out, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = x.view(x.shape[0], 1, 1, x.shape[-1])
        h = self.conv3(self.conv2(self.conv1(h).relu()).relu()).relu()
        return self.linear(h.flatten(1))


class DigitsCNN(nn.Module):
    """conv-BN-ReLU x2, max-pool, then a two-layer MLP head; input (N, 1, 8, 8)."""

    def __init__(self, width: int = 8, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 16, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class SelfAttention(nn.Module):
    """Multi-head self-attention (causal or not) with a fused qkv projection."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, causal: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`."""

    vocab: int
    context: int
    dim: int
    depth: int
    heads: int
    mlp_ratio: int = 4


class GPT(nn.Module):
    """Decoder-only transformer: token ids (N, T) -> logits (N, T, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.context, config.dim)
        self.blocks = nn.Sequential(
            *(Block(config.dim, config.heads, config.mlp_ratio, True) for _ in range(config.depth))
        )
        self.ln = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tokens(idx) + self.positions(pos))))


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM built from ``config`` with fresh weights: token ids
    (N, T) -> logits (N, T, vocab). Needs the ``models`` extra."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


def llama_small(vocab: int = 256, context: int = 128) -> HFCausalLM:
    """A CPU-sized LLaMA: 4 layers, width 128, 4 heads, SwiGLU width 384, RMSNorm, rotary
    positions, untied head (0.92 M parameters at vocab 256)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    return HFCausalLM(config)


class ViT(nn.Module):
    """Vision transformer: conv patch embedding, class token, learned positions."""

    def __init__(
        self, image: int, patch: int, dim: int, depth: int, heads: int, classes: int
    ) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, 4, False) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patches(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        return self.head(self.ln(self.blocks(x))[:, 0])


class PatchViT(nn.Module):
    """Vision transformer over pre-cut patches: a linear patch embedding, learned position
    embeddings, ``depth`` pre-LN :class:`Block` s (fused qkv, output and MLP projections, all
    ``nn.Linear``), a final LayerNorm, mean pooling over the patches and a linear head.

    Input (N, patches, patch_dim) float; output (N, classes) logits.
    """

    def __init__(
        self,
        patches: int = 16,
        patch_dim: int = 4,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 2,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(patch_dim, dim)
        self.positions = nn.Parameter(0.02 * torch.randn(1, patches, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_ratio, False) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.embed(x) + self.positions)
        return self.head(self.ln(h).mean(dim=1))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv-BN, identity or 1x1 conv-BN shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stem without max-pool, four stages, global pool, linear."""

    def __init__(self, blocks: tuple[int, ...], classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64))
        layers, cin = [], 64
        for stage, count in enumerate(blocks):
            cout = 64 * 2**stage
            for i in range(count):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(F.relu(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet18(classes: int = 10) -> ResNet:
    """ResNet-18 for 32x32 inputs (11.2 M parameters)."""
    return ResNet((2, 2, 2, 2), classes)


def vit_tiny(classes: int = 10) -> ViT:
    """ViT-Ti/4 for 32x32 inputs: dim 192, depth 12, 3 heads (5.4 M parameters)."""
    return ViT(image=32, patch=4, dim=192, depth=12, heads=3, classes=classes)


def gpt_tiny() -> GPT:
    """A tiny GPT: byte vocabulary, context 128, dim 256, depth 4, 4 heads (3.3 M parameters)."""
    return GPT(GPTConfig(vocab=256, context=128, dim=256, depth=4, heads=4))
