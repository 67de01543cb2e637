import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zpp_jax import make_mesh
from zpp_jax.lowlevel import mesh_shape
from zpp_jax.mesh import place


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8), (8, 1)])
def test_sizes(shape):
    m = make_mesh(*shape)
    assert mesh_shape(m) == shape
    assert m.axis_names == ("node", "local")
    # node-major: device (n, l) is the n*local + l-th device
    flat = [d.id for d in m.devices.reshape(-1)]
    assert flat == sorted(flat)


def test_one_size_inferred():
    assert mesh_shape(make_mesh(nodes=2)) == (2, 4)
    assert mesh_shape(make_mesh(local=2)) == (4, 2)


def test_single_process_default_is_one_node():
    assert mesh_shape(make_mesh()) == (1, 8)


def test_subset_of_devices():
    assert mesh_shape(make_mesh(1, 4, devices=jax.devices()[:4])) == (1, 4)


@pytest.mark.parametrize("shape", [(3, 4), (2, 2), (3, None), (None, 3)])
def test_mismatch_names_the_fix(shape):
    with pytest.raises(ValueError, match="does not match the 8 devices"):
        make_mesh(*shape)


@pytest.mark.parametrize("shape", [(0, 8), (-2, 4), (2, 0)])
def test_non_positive(shape):
    with pytest.raises(ValueError, match="must be a positive int"):
        make_mesh(*shape)


def _programs(f):
    """(f(), how many programs were lowered while it ran: a program found in
    the compilation cache is lowered all the same)."""
    count = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            count.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        return f(), len(count)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_place_splits_a_cpu_array_exactly_and_compiles_nothing(dtype):
    mesh = make_mesh(2, 4)
    value = jax.device_put(np.arange(3 * 16 * 5).reshape(3, 16, 5).astype(dtype), jax.devices()[1])
    placed, programs = _programs(lambda: place(value, mesh, 1))
    assert programs == 0
    assert placed.sharding.spec == P(None, ("node", "local"), None)
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(value)[shard.index])


def test_place_keeps_keys_and_abstract_values():
    mesh = make_mesh(2, 4)
    keys = jax.random.split(jax.random.key(0), 8)
    placed = place(keys, mesh, 0)
    assert jax.numpy.array_equal(jax.random.key_data(placed), jax.random.key_data(keys))
    abstract = place(jax.ShapeDtypeStruct((8, 3), "float32"), mesh, 0)
    assert isinstance(abstract, jax.ShapeDtypeStruct)
    assert abstract.sharding.spec == P(("node", "local"), None)
