"""A transformer described by its dimensions alone, profiled analytically.

For models gpuflow does not build (such as Llama 3.1 8B): parameters, FLOPs and saved
activations per sample follow from the layer count, widths, heads and vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpuflow.errors import UserError
from gpuflow.planner.profile import ModelProfile
from gpuflow.precision import autocast_dtype


@dataclass(frozen=True)
class TransformerDims:
    """A decoder-only transformer by its dimensions, profiled analytically.

    ``gated`` MLPs (SwiGLU) have three matrices, plain ones two; ``kv_heads`` < ``heads`` is
    grouped-query attention. Attention is assumed to be a fused (flash) kernel that saves
    q, k, v, its output and a log-sum-exp, never the T x T scores.
    """

    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    tied: bool = True
    bias: bool = True
    learned_pos: bool = True
    name: str = "transformer"

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * (self.kv_heads or self.heads)

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.dim

    def parameters(self) -> tuple[int, int, int]:
        """(all, in blocks, split by tensor parallelism)."""
        d, f, kv, v = self.dim, self.ffn_dim, self.kv_dim, self.vocab
        b = int(self.bias)
        norms = 2 * d * (1 + b)
        attn = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + b * d
        mlp = (3 if self.gated else 2) * d * f + b * (f + d)
        tp = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + (3 if self.gated else 2) * d * f + b * f
        block = norms + attn + mlp
        outer = v * d + (self.seq * d if self.learned_pos else 0) + d * (1 + b)
        outer += 0 if self.tied else v * d
        return outer + self.layers * block, self.layers * block, self.layers * tp

    def profile(self, precision: str) -> ModelProfile:
        """Saved bytes per token: fp32 residual stream and norm inputs, the rest in the
        compute dtype (autocast), a log-sum-exp per head, int64 tokens and targets, and
        the fp32 log-softmax of the logits."""
        d, f, kv, t = self.dim, self.ffn_dim, self.kv_dim, self.seq
        a = 2 if autocast_dtype(precision) is not None else 4
        r = 4
        mlp = (4 if self.gated else 2) * f
        # q, k, v; the attention output (laid out so the output projection reads it in
        # place); the MLP's hidden activations.
        sharded = a * ((d + 2 * kv) + d + mlp) + 4 * self.heads
        per_layer = 2 * r * d + a * (2 * d) + sharded
        outer = 16 + r * d + a * d + 4 * self.vocab
        total, block, tp = self.parameters()
        matmul = block - self.layers * (2 * d * (1 + int(self.bias)))
        head = self.vocab * d
        flops = 6 * (matmul + head) * t + 12 * self.layers * d * t * t
        const = 0.0 if a == 4 else a * (matmul + head)
        return ModelProfile(
            name=self.name, precision=precision, params=total, block_params=block,
            tp_params=tp, layers=self.layers, flops_per_sample=float(flops),
            act_per_sample=float(t * (self.layers * per_layer + outer)),
            act_block_per_sample=float(t * self.layers * per_layer),
            act_tp_per_sample=float(t * self.layers * sharded),
            block_input_per_sample=float(t * r * d),
            # Twice the fp32 logits, which the loss saves last; or twice the last block's MLP
            # hidden, less what is saved after it (about all of `outer`).
            backward_excess_per_sample=float(t * max(8 * self.vocab, 2 * a * f - outer)),
            largest_block_saved_per_sample=float(t * a * f), act_const=const,
            tokens_per_sample=t, source="analytic (dimensions)",
            output_per_sample=float(t * a * self.vocab),
            act_before_blocks_per_sample=float(8 * t),  # the embedding saves the token ids
            batch_per_sample=float(16 * t),  # int64 tokens and targets
            front_peak_per_sample=float(t * 2 * r * d),  # token embeddings, plus positions
        )


TRANSFORMER_PRESETS: dict[str, TransformerDims] = {
    # Llama 3.1 8B (Meta's model card / params.json): 32 x 4096, 32 heads, 8 KV heads,
    # SwiGLU 14336, vocabulary 128256, untied head, RoPE, no biases; torchtitan trains at 8192.
    "llama3-8b": TransformerDims(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336,
                                 vocab=128256, seq=8192, gated=True, tied=False, bias=False,
                                 learned_pos=False, name="llama3-8b"),
}
DIM_KEYS = {"layers": int, "dim": int, "heads": int, "kv_heads": int, "ffn": int,
            "vocab": int, "seq": int, "gated": bool, "tied": bool, "bias": bool}


def parse_transformer(spec: str) -> TransformerDims:
    """``llama3-8b``, or ``layers=32,dim=4096,heads=32,vocab=128256,seq=8192[,...]``,
    or a preset followed by overrides (``llama3-8b,seq=4096``)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    base: TransformerDims | None = None
    if parts and "=" not in parts[0]:
        name = parts.pop(0)
        if name not in TRANSFORMER_PRESETS:
            raise UserError(f"--transformer: unknown preset {name!r}; known: "
                            f"{', '.join(TRANSFORMER_PRESETS)}, or give dimensions.")
        base = TRANSFORMER_PRESETS[name]
    values: dict[str, Any] = {}
    for part in parts:
        key, _, raw = part.partition("=")
        if key not in DIM_KEYS:
            raise UserError(f"--transformer: unknown key {key!r}; keys: {', '.join(DIM_KEYS)}.")
        kind = DIM_KEYS[key]
        try:
            values[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
        except ValueError:
            raise UserError(f"--transformer: {key}={raw!r} is not a {kind.__name__}.") from None
    if base is not None:
        return replace(base, **values)
    missing = [k for k in ("layers", "dim", "heads", "vocab", "seq") if k not in values]
    if missing:
        raise UserError(f"--transformer needs {', '.join(missing)} (or a preset: "
                        f"{', '.join(TRANSFORMER_PRESETS)}).")
    return TransformerDims(**values)
