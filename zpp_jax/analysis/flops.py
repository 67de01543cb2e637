"""Model FLOPs, for MFU: the matrix multiplies a model's forward pass does,
counted from its jaxpr.

`matmul_flops(fn, *args)` traces `fn` (nothing runs, abstract arguments
will do) and sums ``2 x M x N x K`` over every ``dot_general`` and the
multiply-adds of every convolution, inside calls, remat regions and
conditionals (the costliest branch), and a ``scan`` body's once per
iteration. `training_flops` is three times a loss's (the backward pass does
two multiplies per forward one): the "model FLOPs" of MFU as PaLM defines
it, which leaves out elementwise work, and the recomputation a remat
policy adds, whatever the program does.

`peak_matrix_flops` reads a GPU's dense matrix peak from XLA's target
description, so that MFU is model FLOPs over step x that peak.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn


def matmul_flops(fn: Callable, *args: Any) -> int:
    """FLOPs of the matrix multiplies and convolutions `fn(*args)` does
    (``jax.make_jaxpr``: traced, not run; `args` may be shape/dtype
    structs). A ``while`` loop, whose trip count the jaxpr does not hold,
    raises ValueError."""
    return _jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def training_flops(loss: Callable, *args: Any) -> int:
    """Model FLOPs of one training step of `loss(*args)`: three times its
    forward pass's `matmul_flops` (the backward pass multiplies twice per
    forward multiply: for the inputs' and the weights' gradients)."""
    return 3 * matmul_flops(loss, *args)


def _jaxpr_flops(jaxpr: Jaxpr) -> int:
    return sum(_eqn_flops(eqn) for eqn in jaxpr.eqns)


def _eqn_flops(eqn: JaxprEqn) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        return _dot_flops(eqn)
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    if name == "while":
        raise ValueError(
            "a while loop: its trip count is not in the program, so its FLOPs are unknown "
            "(count a scan, or the loop's body times its trips)"
        )
    inner = [_jaxpr_flops(j) for j in _inner_jaxprs(eqn)]
    if name == "cond":
        return max(inner, default=0)
    return sum(inner) * (eqn.params["length"] if name == "scan" else 1)


def _inner_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    """The jaxprs an equation's parameters hold (a call's, a loop's body, a
    conditional's branches, a custom derivative's primal)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found


def _dot_flops(eqn: JaxprEqn) -> int:
    """2 x the output's elements x the contracted elements."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contracted = math.prod(lhs[d] for d in lhs_contract)
    return 2 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _conv_flops(eqn: JaxprEqn) -> int:
    """2 x the output's elements x one output element's multiply-adds (the
    kernel's elements over its output features)."""
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    per_output = math.prod(kernel) // out_features
    return 2 * math.prod(eqn.outvars[0].aval.shape) * per_output


# XLA's PrimitiveType numbers of the matrix units' rates in a target
# description (``matrix_unit_description``).
_ELEMENT_TYPES = {"bfloat16": 16, "float16": 10, "float32": 11}


def peak_matrix_flops(target_description: str, dtype: str = "bfloat16") -> float | None:
    """The GPU's dense matrix peak in FLOP/s for `dtype`, from an XLA GPU
    target description (text format: a ``.txtpb`` or the
    ``*.gpu_target_config.pbtxt`` XLA dumps): cores x matrix units per core
    x multiply-adds per clock x clock x 2. None if it holds no rate for
    `dtype`. (For an H200 in bfloat16: 989 TFLOP/s, its published dense
    peak.)"""
    key = _ELEMENT_TYPES[dtype]
    cores = re.search(r"^\s*core_count:\s*(\d+)", target_description, re.M)
    matrix = target_description.split("matrix_unit_description", 1)
    rate = re.search(
        rf"key:\s*{key}\s+value\s*{{\s*clock_rate_ghz:\s*([\d.]+)\s+units_per_core:\s*(\d+)"
        rf"\s+ops_per_clock:\s*(\d+)",
        matrix[1] if len(matrix) == 2 else "",
    )
    if cores is None or rate is None:
        return None
    ghz, units, per_clock = float(rate.group(1)), int(rate.group(2)), int(rate.group(3))
    return 2.0 * int(cores.group(1)) * units * per_clock * ghz * 1e9
