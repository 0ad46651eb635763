"""Weight-only quantization of the served model through torchao (``--quantize int8``).

int8 swaps the weight of each ``nn.Linear`` for torchao's ``Int8Tensor``: int8 values with
one fp32 scale per output row (symmetric), a quarter of fp32's bytes, which its own
``F.linear`` multiplies by the activations in their dtype. Activations keep the runner's
precision: fp32, or bf16 (fp16) under ``--precision bf16`` (``fp16``), whose autocast runs
the matmul of the dequantized weight in bf16 (fp16). Embeddings, norms and biases keep their
precision, and so does a linear layer whose weight is tied to another module (gpuflow's GPT
head shares the token embedding): quantizing it would add an int8 copy beside the weight the
embedding still reads. ``--compile`` compiles the quantized model (torchao's tensors are
traceable); torchao's global inductor settings are left alone, as the rest of the server's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from gpuflow.errors import UserError

SCHEMES = ("int8",)
INSTALL_HINT = "pip install 'gpuflow[fp8]' (its extra carries torchao)"


@dataclass(frozen=True)
class Quantized:
    """What quantization did, for /readyz and the start-up log."""

    scheme: str
    layers: int  # linear layers whose weights are now int8
    tied: int  # linear layers kept in their precision: their weight is shared
    fraction: float  # of the model's parameters that are now int8

    def describe(self) -> str:
        kept = f"; {self.tied} tied to another module kept" if self.tied else ""
        return (f"{self.scheme} weights in {self.layers} linear layers ({self.fraction:.0%} "
                f"of the parameters, per-row scales{kept})")


def quantization_api(scheme: str) -> Any:
    """torchao's quantization module for a scheme gpuflow serves; refuses an unknown scheme
    or a missing torchao, naming the fix (the CLI asks before anything loads)."""
    if scheme not in SCHEMES:
        raise UserError(f"--quantize {scheme} is not a scheme gpuflow serves; use "
                        f"{' or '.join(SCHEMES)}, or drop --quantize.")
    try:
        import torchao.quantization as quantization
    except ImportError:
        raise UserError(f"--quantize {scheme} quantizes through torchao: {INSTALL_HINT}, "
                        "or drop --quantize.") from None
    return quantization


def quantize_weights(model: nn.Module, scheme: str) -> Quantized:
    """Quantize ``model``'s untied linear weights in place, on the device they are on."""
    quantization = quantization_api(scheme)
    shares = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    chosen = {id(m) for m in linears if shares[id(m.weight)] == 1}
    if not chosen:
        found = "only linear layers tied to another module" if linears else "no linear layers"
        raise UserError(f"--quantize {scheme} quantizes the weights of nn.Linear layers, and "
                        f"{type(model).__name__} has {found}: drop --quantize.")
    total = sum(p.numel() for p in model.parameters())
    weights = sum(m.weight.numel() for m in linears if id(m) in chosen)
    config = quantization.Int8WeightOnlyConfig(set_inductor_config=False)
    quantization.quantize_(model, config, filter_fn=lambda module, _: id(module) in chosen)
    return Quantized(scheme, len(chosen), len(linears) - len(chosen), weights / total)
