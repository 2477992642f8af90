"""A Transformer encoder (Vaswani et al., 2017), BERT-style post-LN layers.

Token embedding + learned positions, then ``LAYERS`` encoder layers: fused
QKV projection, multi-head scaled dot-product attention written as explicit
batched matmuls and a softmax (so FLOPs are counted and the graph shows the
real ops), output projection, residual + LayerNorm, GELU feed-forward,
residual + LayerNorm.  Defaults: 6 layers, d_model 256 (``width`` scales it),
4 heads, feed-forward 4 d_model, 64 tokens, vocabulary 8000; ~100 ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsched.zoo._layers import scaled

LAYERS = 6
D_MODEL = 256
HEADS = 4
SEQ = 64
VOCAB = 8000


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.ff2 = nn.Linear(4 * d, d)
        self.norm2 = nn.LayerNorm(d)
        self.scale = (d // heads) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d)
        x = self.norm1(x + self.proj(ctx))
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


class Encoder(nn.Module):
    def __init__(self, width: float = 1.0, layers: int = LAYERS, heads: int = HEADS) -> None:
        super().__init__()
        d = scaled(D_MODEL, width, minimum=heads * 4)
        d -= d % heads
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, SEQ, d))
        self.layers = nn.Sequential(*(EncoderLayer(d, heads) for _ in range(layers)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embed(tokens) + self.pos)


def build(batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    model = Encoder(width)
    gen = torch.Generator().manual_seed(seed)
    return model.eval(), (torch.randint(0, VOCAB, (batch, SEQ), generator=gen),)
