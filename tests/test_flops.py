import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from zpp_jax.analysis.flops import matmul_flops, peak_matrix_flops, training_flops
from zpp_jax.cli.comm import device_training_flops
from zpp_jax.models import GPT, GPTConfig

S = jax.ShapeDtypeStruct


def test_a_matrix_multiply_is_two_flops_per_multiply_add():
    x, w = S((3, 5, 7), jnp.float32), S((7, 11), jnp.bfloat16)
    assert matmul_flops(lambda x, w: x @ w.astype(x.dtype), x, w) == 2 * 3 * 5 * 7 * 11
    # batched: the batch dimension counts once per output, not as contracted
    q, k = S((2, 4, 8, 16), jnp.float32), S((2, 4, 9, 16), jnp.float32)
    assert matmul_flops(lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), q, k) == (
        2 * 2 * 4 * 8 * 9 * 16
    )


def test_loops_calls_and_branches():
    w = S((8, 8), jnp.float32)

    def layers(w, x):
        def body(x, _):
            return jnp.tanh(x @ w), None

        return jax.lax.scan(body, x, None, length=5)[0]

    x = S((4, 8), jnp.float32)
    one = 2 * 4 * 8 * 8
    assert matmul_flops(layers, w, x) == 5 * one
    assert matmul_flops(jax.jit(jax.checkpoint(lambda w, x: (x @ w) @ w)), w, x) == 2 * one

    def branches(p, w, x):
        return jax.lax.cond(p, lambda: (x @ w) @ w, lambda: x @ w)

    assert matmul_flops(branches, S((), bool), w, x) == 2 * one  # the costlier branch
    conv = matmul_flops(
        lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID"),
        S((2, 3, 10, 10), jnp.float32),  # NCHW
        S((6, 3, 3, 3), jnp.float32),  # OIHW
    )
    assert conv == 2 * (2 * 6 * 8 * 8) * (3 * 3 * 3)
    with pytest.raises(ValueError, match="while loop: its trip count"):
        matmul_flops(lambda w: jax.lax.while_loop(lambda c: c[0, 0] < 1, lambda c: c @ c, w), w)


def test_a_gpt_step_is_three_forward_passes_of_its_matrix_multiplies():
    """The GPT's forward pass: per layer and token the QKV, output and MLP
    projections (2 x their weights) and attention's two products over every
    key (causal masking computes them all), then the LM head."""
    cfg = GPTConfig.preset("tiny", seq_len=16, n_layers=3)
    d, t, f, v, rows = cfg.d_model, cfg.seq_len, cfg.d_ff, cfg.vocab_size, 2
    layer = 2 * (3 * d * d + d * d + 2 * d * f) + 2 * 2 * t * d
    forward = rows * t * (cfg.n_layers * layer + 2 * d * v)
    model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
    assert device_training_flops(model, rows, t) == 3 * forward
    graphdef, state = nnx.split(model)
    tokens = S((rows, t), jnp.int32)
    assert training_flops(lambda s, x: nnx.merge(graphdef, s)(x), state, tokens) == 3 * forward


# The H200's matrix units as XLA's target description gives them.
_H200 = """
gpu_device_info {
  core_count: 132
  scalar_unit_description {
    rate_infos { key: 16 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
  }
  matrix_unit_description {
    rate_infos { key: 11 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 256 } }
    rate_infos {
      key: 16
      value {
        clock_rate_ghz: 1.8295201
        units_per_core: 4
        ops_per_clock: 512
      }
    }
  }
}
"""


def test_the_matrix_peak_is_read_from_the_target_description():
    """989 TFLOP/s: the H200's published dense bfloat16 peak."""
    assert peak_matrix_flops(_H200) == pytest.approx(989.17e12, rel=1e-4)
    assert peak_matrix_flops(_H200, "float32") == pytest.approx(989.17e12 / 2, rel=1e-4)
    assert peak_matrix_flops(_H200, "float16") is None
    assert peak_matrix_flops(_H200.replace("matrix_unit_description", "x")) is None
