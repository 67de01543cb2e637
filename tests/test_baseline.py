import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from zpp_jax import UsageError
from zpp_jax.analysis import step_report
from zpp_jax.baseline import JitFSDP, NoCommunication, fsdp_sharding
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.models.gpt import Embed
from zpp_jax.train import next_token_loss

CFG = GPTConfig.preset("tiny", seq_len=16, dtype="float32")


def _batch(seed=0, b=8):
    tokens = jax.random.randint(jax.random.key(seed), (b, CFG.seq_len + 1), 0, CFG.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _one_device_step(graphdef, rest, tx):
    """The unsharded training step: (params, opt_state, batch) -> (params,
    opt_state, loss), on one device."""

    @jax.jit
    def step(params, opt_state, batch):
        def loss(p):
            return next_token_loss(nnx.merge(graphdef, p, rest), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def test_fsdp_sharding_splits_the_largest_dimension_the_devices_divide(mesh24):
    assert fsdp_sharding(mesh24, (64, 256)).spec == P(None, ("node", "local"))
    assert fsdp_sharding(mesh24, (256, 64)).spec == P(("node", "local"), None)
    # The largest dimension (36) is not a multiple of 8 devices: the next one.
    assert fsdp_sharding(mesh24, (36, 16)).spec == P(None, ("node", "local"))
    assert fsdp_sharding(mesh24, (3, 5)).spec == P()
    assert fsdp_sharding(mesh24, ()).spec == P()


@pytest.mark.slow  # a baseline, not the engine; the engine's exactness stays in the loop
@pytest.mark.parametrize(
    "constrain",
    [False, True],
    ids=["xla-partitioned", "constrained"],
)
def test_a_step_equals_the_unsharded_step(mesh24, constrain):
    # Plain SGD: the sharded sums differ from the unsharded ones in the last
    # bits, which Adam's normalization would magnify for near-zero gradients.
    tx = optax.sgd(0.5, momentum=0.9)
    baseline = JitFSDP(GPT(CFG, nnx.Rngs(0)), tx, mesh24, constrain_activations=constrain)
    state = baseline.init()
    params, opt_state, rest, step = state
    assert JitFSDP.steps_done(state) == 0
    wte = params["embed"]["tokens"]["embedding"]
    assert wte.get_value().sharding.spec == P(("node", "local"), None)

    # The reference: the same model, one device, no shardings.
    graphdef, ref_params, ref_rest = nnx.split(GPT(CFG, nnx.Rngs(0)), nnx.Param, ...)
    ref_opt = tx.init(ref_params)
    reference = _one_device_step(graphdef, ref_rest, tx)

    for i in range(2):
        batch = jax.device_put(_batch(i), baseline.batch_sharding())
        state, metrics = baseline.train_step(state, batch)
        ref_params, ref_opt, ref_loss = reference(ref_params, ref_opt, _batch(i))
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert JitFSDP.steps_done(state) == 2
    # The eval step is the loss of the current parameters, as the reference's.
    batch = jax.device_put(_batch(2), baseline.batch_sharding())
    want = next_token_loss(nnx.merge(graphdef, ref_params, ref_rest), _batch(2))
    np.testing.assert_allclose(float(baseline.eval_step(state, batch)), float(want), rtol=1e-5)


def test_mixed_precision_casts_the_weights_and_keeps_fp32_parameters(mesh24):
    baseline = JitFSDP(GPT(CFG, nnx.Rngs(0)), optax.sgd(1e-2), mesh24, compute_dtype=jnp.bfloat16)
    state, metrics = baseline.train_step(
        baseline.init(), jax.device_put(_batch(), baseline.batch_sharding())
    )
    assert np.isfinite(float(metrics["loss"]))
    assert {x.dtype for x in jax.tree.leaves(state[0])} == {jnp.dtype(jnp.float32)}
    with pytest.raises(UsageError, match="floating dtype"):
        JitFSDP(GPT(CFG, nnx.Rngs(0)), optax.sgd(1e-2), mesh24, compute_dtype=jnp.int8)


def test_an_abstract_model_compiles_and_reports(mesh24):
    abstract = nnx.eval_shape(lambda: GPT(CFG, nnx.Rngs(0)))
    baseline = JitFSDP(abstract, optax.adamw(1e-3), mesh24)
    with pytest.raises(UsageError, match="abstract model"):
        baseline.init()
    tokens = jax.ShapeDtypeStruct((8, CFG.seq_len), jnp.int32)
    report = step_report(baseline, {"inputs": tokens, "targets": tokens})
    kinds = {c["kind"] for c in report["collectives"]}
    assert "all-gather" in kinds
    assert report["cross_node_bytes"] > 0 and report["peak_memory_bytes"] > 0
    # Parameters and both Adam moments, sharded: a device holds about 3/8 of
    # the fp32 parameters (small leaves are replicated).
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert 3 * 4 * n / 8 <= report["state_bytes"] <= 3 * 4 * n / 8 * 1.2


@pytest.mark.slow  # a second compiled baseline step
def test_constrained_activations_make_xla_gather_the_weights(mesh24):
    """With the activations constrained to the batch axes, the step's
    collectives are the weights' gathers (each parameter in the forward
    pass, and the scanned layers' again in the backward pass, as FSDP
    does) and the gradients' reductions; no activation is resharded (no
    all-to-all, no permute).
    Left to itself XLA's partitioner moves activations as well."""
    model = GPT(CFG, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    tokens = jax.ShapeDtypeStruct((8, CFG.seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    sharded = sum(
        x.size * 4 for x in jax.tree.leaves(params) if fsdp_sharding(mesh24, x.shape).spec != P()
    )
    constrained = JitFSDP(model, optax.sgd(1e-2), mesh24, constrain_activations=True)
    gathered = moved = 0
    for c in step_report(constrained, batch)["collectives"]:
        assert c["kind"] in ("all-gather", "all-reduce", "reduce-scatter"), c
        if c["kind"] == "all-gather":
            gathered += c["bytes"] * c["runs"]

    def size(path, x):
        return x.size * 4 if fsdp_sharding(mesh24, x.shape).spec != P() else 0

    flat = [(path, x.get_value()) for path, x in nnx.to_flat_state(params)]
    layers = sum(size(p, x) for p, x in flat if p[0] == "blocks")
    kernels = sum(size(p, x) for p, x in flat if p[0] == "blocks" and p[-1] == "kernel")
    table = CFG.vocab_size * CFG.d_model * 4  # read by a take: its rows are summed instead
    # Every weight but the table in the forward pass, every layer kernel
    # again in the backward pass; at most every layer parameter again, the
    # tokens and the rows the take's transpose gathers.
    assert (
        sharded - table + kernels <= gathered <= sharded + layers + 8 * CFG.seq_len * 4 + table // 2
    )
    for c in step_report(JitFSDP(model, optax.sgd(1e-2), mesh24), batch)["collectives"]:
        moved += c["kind"] in ("all-to-all", "collective-permute")
    assert moved  # the unconstrained plan reshards activations
    # The model passed in is unchanged: its classes are its own.
    assert type(model) is GPT and type(model.embed) is Embed


@pytest.mark.slow  # a baseline, not the engine
def test_no_communication_trains_each_replica_as_one_device_does(mesh24):
    """Each device's replica after two steps is the model trained on that
    device's rows alone, on one device; the step's only collective is the
    gathered losses (4 bytes a device), and each device keeps the whole
    model's state. (SGD: Adam's normalization would magnify the last bits
    in which the unrolled layer loop's sums differ, for near-zero gradients.)"""
    tx = optax.sgd(0.5, momentum=0.9)
    program = NoCommunication(GPT(CFG, nnx.Rngs(0)), tx, mesh24)
    state = program.init()
    graphdef, params, rest = nnx.split(GPT(CFG, nnx.Rngs(0)), nnx.Param, ...)
    one_device = _one_device_step(graphdef, rest, tx)

    rows = [(params, tx.init(params)) for _ in range(8)]
    for step in range(2):
        batch = _batch(step)
        state, metrics = program.train_step(state, jax.device_put(batch, program.batch_sharding()))
        losses = []
        for i in range(8):
            mine = jax.tree.map(lambda x, i=i: x[i : i + 1], batch)
            p, o, value = one_device(*rows[i], mine)
            rows[i] = (p, o)
            losses.append(float(value))
        np.testing.assert_allclose(float(metrics["loss"]), np.mean(losses), rtol=1e-6)
    assert NoCommunication.steps_done(state) == 2
    for i in (0, 5):
        got = jax.tree.map(lambda x, i=i: np.asarray(x)[i], jax.tree.leaves(state[0]))
        for a, b in zip(got, jax.tree.leaves(rows[i][0]), strict=True):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)
    # The replicas differ: their rows did.
    first = jax.tree.leaves(state[0])[0]
    assert not np.allclose(np.asarray(first)[0], np.asarray(first)[5])

    tokens = jax.ShapeDtypeStruct((8, CFG.seq_len), jnp.int32)
    report = step_report(program, {"inputs": tokens, "targets": tokens})
    assert [(c["kind"], c["bytes"]) for c in report["collectives"]] == [("all-gather", 8 * 4)]
    n = sum(x.size for x in jax.tree.leaves(params))
    assert 2 * 4 * n <= report["state_bytes"] <= 2 * 4 * n + 64  # parameters and momentum


@pytest.mark.slow  # a baseline, not the engine
@pytest.mark.parametrize("constrain", [False, True], ids=["xla-partitioned", "constrained"])
def test_with_a_model_axis_each_parameter_is_split_as_named_and_a_step_equals_one_device(
    constrain,
):
    """Plain jax.jit with FSDP over 2 x 2 data devices and tensor
    parallelism of 2 (`JitFSDP` on a (node, local, model) mesh, the Llama's
    names mapped by the rules): each parameter lies along `model` as its
    names say and over the data axes on another dimension, the optimizer
    state as its parameter, and two SGD steps equal one device's."""
    from zpp_jax import make_mesh
    from zpp_jax.models import Llama, LlamaConfig
    from zpp_jax.models.names import TENSOR_PARALLEL_RULES, name_axes

    cfg = LlamaConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, d_ff=64)
    mesh, tx = make_mesh(2, 2, model=2), optax.sgd(0.5, momentum=0.9)
    model = name_axes(Llama(cfg, nnx.Rngs(0)))
    baseline = JitFSDP(
        model, tx, mesh, rules=TENSOR_PARALLEL_RULES, constrain_activations=constrain
    )
    state = baseline.init()
    up = state[0]["layers"][0]["mlp"]["up"]["kernel"]
    assert up.get_value().sharding.spec == P(("node", "local"), "model")
    momentum = state[1][0].trace["layers"][0]["mlp"]["up"]["kernel"]
    assert momentum.get_value().sharding.spec == P(("node", "local"), "model")
    graphdef, ref_params, ref_rest = nnx.split(Llama(cfg, nnx.Rngs(0)), nnx.Param, ...)
    ref_opt, reference = tx.init(ref_params), _one_device_step(graphdef, ref_rest, tx)
    for i in range(2):
        tokens = jax.random.randint(jax.random.key(i), (8, 17), 0, 64)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        state, metrics = baseline.train_step(
            state, jax.device_put(batch, baseline.batch_sharding())
        )
        ref_params, ref_opt, ref_loss = reference(ref_params, ref_opt, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_model_axis_that_no_name_maps_to_is_refused_for_the_baseline_too():
    from zpp_jax import make_mesh

    with pytest.raises(UsageError, match="no parameter's sharding names map to 'model'"):
        JitFSDP(GPT(CFG, nnx.Rngs(0)), optax.sgd(0.1), make_mesh(2, 2, model=2))
