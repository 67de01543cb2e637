"""Multi-host ZeRO++ training: one process per host, node = process.

On one machine, as 2 nodes x 4 CPU devices:

    zpp launch --nodes 2 -- python examples/multihost.py

On GPU hosts, start this script once per host with the ZPP_* variables set
(or under SLURM, where jax.distributed finds the job by itself), e.g.

    srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 python examples/multihost.py

Every process runs the same program on its own devices; the batch is built
from the same host data in every process, and each process copies only the
rows of its own devices.
"""

import zpp_jax as zpp

zpp.distributed.initialize()  # before anything touches a device

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from zpp_jax.models import GPT, GPTConfig  # noqa: E402

mesh = zpp.node_mesh()
cfg = GPTConfig.preset("tiny", dtype="float32")
trainer = zpp.Trainer(GPT(cfg, nnx.Rngs(0)), optax.adamw(3e-3), mesh, zpp.ZeroPPConfig())
state = trainer.init()
data = zpp.data.TokenDataset(zpp.data.stdlib_corpus(1 << 20), cfg.seq_len)
for i in range(5):
    batch = zpp.data.host_to_global(
        data.batch("train", i, 2 * mesh.size, seed=0), trainer.batch_sharding()
    )
    state, metrics = trainer.train_step(state, batch)
    if jax.process_index() == 0:
        print(
            f"step {i + 1}: loss {float(metrics['loss']):.4f}  ({jax.process_count()} processes, "
            f"mesh {dict(mesh.shape)})"
        )
