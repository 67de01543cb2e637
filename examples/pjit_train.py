"""`jax.jit` with explicit `NamedSharding` in/out shardings (the pjit style)
around the library's training step, for a tiny GPT on 2 x 4 emulated devices.

    python examples/pjit_train.py
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zpp_jax as zpp  # noqa: E402

mesh = zpp.make_mesh(nodes=2, local=4)
model = zpp.GPT(zpp.GPTConfig.preset("tiny"), nnx.Rngs(0))
trainer = zpp.Trainer(zpp.nnx_parts(model), optax.adamw(3e-3), mesh, zpp.ZeroPPConfig())
state = trainer.init()

state_shardings = trainer.state_shardings(state)  # primary shards over ("node", "local")
batch_sharding = NamedSharding(mesh, P(zpp.AXES))  # batch axis over every device
replicated = NamedSharding(mesh, P())
step = jax.jit(
    trainer.train_step,
    in_shardings=(state_shardings, {"inputs": batch_sharding, "targets": batch_sharding}),
    out_shardings=(state_shardings, replicated),
    donate_argnums=0,
)

data = zpp.ByteDataset(zpp.stdlib_corpus(1 << 20), seq_len=64)
for i in range(10):
    state, metrics = step(state, data.batch("train", i, batch_size=16, seed=0))
    print(f"step {i + 1}: loss {float(metrics['loss']):.4f}")
