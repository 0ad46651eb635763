"""A GPT-style decoder-only transformer: small enough to read, shaped like GPT-2.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> 4x GELU MLP ->
residual), learned position embeddings, a final LayerNorm and an LM head tied to the token
embedding. The linear layers carry stable names (``attn.qkv``, ``attn.proj``, ``mlp.fc``,
``mlp.proj``) because tensor-parallel plans address them by name: ``qkv`` and ``fc`` split
by output columns, ``attn.proj`` and ``mlp.proj`` by input rows.

The model knows nothing of parallelism, precision or telemetry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT. ``seq_len`` is the context the position table covers."""

    vocab_size: int = 256
    seq_len: int = 256
    layers: int = 4
    dim: int = 128
    heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "layers", "dim", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1) (got {self.dropout})")

    def num_parameters(self) -> int:
        """Parameters of the model this config builds (tied head counted once)."""
        d, v, t = self.dim, self.vocab_size, self.seq_len
        per_block = (2 * 2 * d                      # two LayerNorms
                     + 3 * d * d + 3 * d            # attn.qkv
                     + d * d + d                    # attn.proj
                     + 4 * d * d + 4 * d            # mlp.fc
                     + 4 * d * d + d)               # mlp.proj
        return v * d + t * d + self.layers * per_block + 2 * d


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention(is_causal=True)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.dropout = config.dropout

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        # qkv's output is laid out head by head, (heads, 3, head_dim), not (3, heads,
        # head_dim): splitting it by columns then hands each tensor-parallel rank whole heads
        # with their q, k and v, and the -1 below is the number of heads held locally.
        qkv = self.qkv(x).view(batch, length, -1, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self._heads(x)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))

class MLP(nn.Module):
    """The position-wise feed-forward network: ``dim -> 4*dim -> GELU -> dim``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.proj = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-norm transformer layer; the unit activation checkpointing and FSDP wrap."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))

class GPT(nn.Module):
    """``forward(tokens[B, T]) -> logits[B, T, vocab]`` for integer tokens, T <= seq_len.

    The LM head shares its weight with the token embedding (``lm_head.weight is
    tok_emb.weight``), as in GPT-2: one fewer ``vocab x dim`` matrix, and the same tensor
    appears under both names in ``state_dict()`` (gpuflow's checkpoints copy tied tensors
    apart for safetensors and the tie is restored by loading into a freshly built model).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.seq_len, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2L)
        so the residual stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                if module is not self.lm_head:  # tied: initialised as the embedding
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.seq_len:
            raise ValueError(f"sequence of {length} tokens is longer than the model's context "
                             f"({self.config.seq_len})")
        positions = torch.arange(length, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_parameters(self) -> int:
        """Distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())
