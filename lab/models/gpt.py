"""A GPT-style decoder: token + position embeddings, pre-norm blocks with causal self-attention, tied head.

GPT-2's architecture (Radford et al. 2019) in nanoGPT's plain form. `GPTConfig(...).build()` makes one; the
presets in lab/models/presets.py pick the sizes (GPT-2 small: 12 layers, 12 heads, width 768, context 1024).
`model.checkpoint_blocks = True` recomputes each block's activations in backward (gradient checkpointing, under the
forward's precision: lab/numerics/recompute.py).

The forward returns logits (batch, time, vocab); the training loop's loss flattens every position into a
row (lab.run.evaluation.flat_cross_entropy), so a language model is a classifier over every position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab.numerics.recompute import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int
    context: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0

    def build(self) -> "GPT":
        return GPT(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        # gradient checkpointing: each block's activations recomputed in backward (lab.checkpoint: under the
        # forward's precision, the same gradients) instead of kept
        self.checkpoint_blocks = False
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence of {T} tokens is longer than the model's context {self.cfg.context}")
        return self.head(self.ln_f(self.hidden(self.tok(idx))))

    def hidden(self, x):
        """The blocks' output for embedded tokens ``x`` (batch, time, width), positions added: the decoder a
        vision-language model feeds its visual tokens to (lab/models/multimodal.py)."""
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = checkpoint(block, x) if self.checkpoint_blocks and torch.is_grad_enabled() else block(x)
        return x


def checkpoint_target(model: nn.Module) -> GPT | None:
    """The lab GPT inside ``model`` whose blocks train.gradient_checkpointing recomputes (``checkpoint_blocks``):
    the model itself, the decoder a vision-language model embeds, the base a LoRA wrapper holds; None for a model
    without one (a CNN, a ViT, a Hugging Face model)."""
    return next((m for m in model.modules() if isinstance(m, GPT)), None)
