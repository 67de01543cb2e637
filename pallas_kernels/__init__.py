"""Block-quantization kernels: one public function per op, dispatched by
platform when the program is lowered (Pallas/Triton on NVIDIA GPUs, the
plain-JAX reference elsewhere; ``interpret=True`` runs the Pallas kernel itself
on any platform).

The numerics are defined by `zpp_jax.quant`; every kernel matches it bit for
bit (codes and scales), NaN and Inf included: a block holding a non-finite
value gets a NaN or Inf scale and zero codes, so it dequantizes to NaN.

Each op lives in its own module (``quantize.py``, ``dequantize.py``,
``requantize.py``, ``reorder.py``), with the kernels in ``_triton.py`` and the
references in ``_reference.py``.
"""

from pallas_kernels.dequantize import dequantize
from pallas_kernels.quantize import quantize
from pallas_kernels.reorder import quantize_reordered
from pallas_kernels.requantize import dequantize_sum_quantize

__all__ = ["dequantize", "dequantize_sum_quantize", "quantize", "quantize_reordered"]
