"""`zpp demo`: sharded training steps of a transformer stack, and what they move."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.analysis import summarize
from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.layer import ShardedLayer, stack_value_and_grad
from zpp_jax.mesh import AXES, make_mesh, mesh_shape
from zpp_jax.models.blocks import block, init_stack
from zpp_jax.partition import to_primary_shards


def run_demo(
    config: ZeroPPConfig,
    nodes: int,
    local: int,
    layers: int,
    d_model: int,
    d_ff: int,
    batch: int,
    seq: int,
    steps: int,
    lr: float,
    seed: int,
) -> int:
    mesh = make_mesh(nodes, local)  # the flags' ranges are the parser's (`zpp_jax.cli`)
    n = nodes * local
    if batch % n:
        raise UsageError(f"--batch {batch} must be a multiple of the {n} devices")
    kp, kx, ky = jax.random.split(jax.random.key(seed), 3)
    shards, layout = to_primary_shards(
        init_stack(kp, layers, d_model, d_ff), mesh, stacked=True, align=config.alignment
    )
    data = NamedSharding(mesh, P(AXES))
    x = jax.device_put(jax.random.normal(kx, (batch, seq, d_model)), data)
    y = jax.device_put(jax.random.normal(ky, (batch, seq, d_model)), data)
    opt = optax.adam(lr)

    def make_step(cfg):
        layer = ShardedLayer(block, layout, cfg)
        grads = stack_value_and_grad(layer, mesh, lambda out, x, y: jnp.mean(jnp.square(out - y)))

        @jax.jit
        def step(shards, opt_state, residuals):
            loss, g, residuals = grads(shards, residuals, x, y)
            updates, opt_state = opt.update(g, opt_state, shards)
            return optax.apply_updates(shards, updates), opt_state, residuals, loss

        return step, layer

    step, layer = make_step(config)
    opt_state = opt.init(shards)
    residuals = layer.init_residuals(mesh, layers) if config.error_feedback else None

    _, local_size = mesh_shape(mesh)
    step = step.lower(shards, opt_state, residuals).compile()  # compiled once, run below
    moved = summarize(step.as_text(), local_size)
    base = summarize(
        make_step(ZeroPPConfig.zero3())[0].lower(shards, opt_state, None).compile().as_text(),
        local_size,
    )
    print(
        f"mesh {nodes} node(s) x {local} device(s); {layers} layers of d_model={d_model}, "
        f"{layout.size * layers:,} parameters; global batch {batch} x {seq} tokens"
    )
    print(f"config: {config}")
    print("bytes per device per step (ring model, from the compiled HLO):")
    print(f"  {'':24s}{'cross-node':>14s}{'intra-node':>14s}")
    print(
        f"  {'ZeRO-3 (bf16 wire)':24s}{base.cross_node_bytes:14,.0f}{base.intra_node_bytes:14,.0f}"
    )
    print(f"  {'this config':24s}{moved.cross_node_bytes:14,.0f}{moved.intra_node_bytes:14,.0f}")
    if moved.cross_node_bytes:
        ratio = base.cross_node_bytes / moved.cross_node_bytes
        print(f"  cross-node traffic: {ratio:.2f}x less than ZeRO-3")
    for i in range(steps):
        shards, opt_state, residuals, loss = step(shards, opt_state, residuals)
        if i == 0 or (i + 1) % max(1, steps // 10) == 0 or i == steps - 1:
            print(f"step {i + 1:4d}  loss {float(loss):.5f}")
    return 0
