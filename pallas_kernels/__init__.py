"""Kernel backends for the block-quantization ops.

The engine's numerics are defined by the plain-JAX reference in
`zpp_jax.quant`; every kernel here must match it bit for bit (codes and
scales).
"""
