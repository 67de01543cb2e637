import jax
import pytest

from zpp_jax import make_mesh
from zpp_jax.lowlevel import mesh_shape


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
