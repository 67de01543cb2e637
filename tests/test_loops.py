"""zpp_jax.overlap.loops: a layer loop whose body starts a relay chain is unrolled
and carries the token; the values are the loop's."""

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_shard import lm_gradient_step, relay_as_on_a_gpu

import zpp_jax as zpp
from zpp_jax import _compat
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.overlap.loops import relay_loops, unroll_every_loop
from zpp_jax.overlap.relay import is_relay_end, is_relay_start, relay_end, relay_start


def _scans(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn)
        for value in eqn.params.values():
            if isinstance(value, jcore.ClosedJaxpr):
                found += _scans(value.jaxpr)
    return found


def _layers(h, ws):
    """A loop over stacked weights whose body relays a token through two
    'units' (a token that each step reads and hands on, as units do)."""

    def body(h, w):
        token = relay_start(4)
        h = jnp.tanh(h @ w) + token[0]
        token = relay_end(token + h.sum())
        h = h * 2.0 + token[1]
        relay_end(token * 0.5)
        return h, h.sum()

    return jax.lax.scan(body, h, ws)


def _carried(carry, w):
    """`_layers`' body with the token carried by hand."""
    h, token = carry
    h = jnp.tanh(h @ w) + token[0]
    token = token + h.sum()
    h = h * 2.0 + token[1]
    return (h, token * 0.5), h.sum()


def test_a_relaying_loop_carries_its_token_and_is_unrolled():
    h, ws = jnp.ones((2, 3)), jax.random.normal(jax.random.key(0), (5, 3, 3))
    closed = jax.make_jaxpr(jax.jit(_layers))(h, ws)
    rewritten = relay_loops(closed.jaxpr)
    (before,), (after,) = _scans(closed.jaxpr), _scans(rewritten)
    carries = lambda loop: _compat.scan_carry(loop)[1]  # noqa: E731
    assert (carries(before), before.params["unroll"]) == (1, 1)
    assert (carries(after), after.params["unroll"]) == (2, 5)
    body = after.params["jaxpr"].jaxpr
    # The fresh token is made once, before the loop; the body takes it as a
    # carry and hands on the last unit's.
    assert not [e for e in body.eqns if is_relay_start(e)]
    assert body.outvars[1] is [e for e in body.eqns if is_relay_end(e)][-1].invars[0]
    jcore.check_jaxpr(rewritten)
    got = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(rewritten, closed.consts))(h, ws)

    def chained(h, ws):  # the same loop written with the token carried by hand
        (h, _), ys = jax.lax.scan(_carried, (h, jnp.zeros(4)), ws)
        return h, ys

    want = chained(h, ws)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert not np.allclose(want[0], _layers(h, ws)[0])  # the carry is what changed


def _model(h, ws):
    """A unit before the loop and one after it, each starting a chain of its
    own as units called outside a loop body do: an embedding, the layers, a
    head."""
    token = relay_start(4)
    h = h + token[0]
    relay_end(token + h.sum())
    h, _ = _layers(h, ws)
    token = relay_start(4)
    h = h * 3.0 + token[2]
    relay_end(token - 1.0)
    return h


def test_the_loop_joins_the_chain_of_the_units_around_it():
    """The loop takes the token the unit before it handed on, and the unit
    after it takes the loop's last token instead of a fresh one: one chain
    from the first unit to the last."""
    h, ws = jnp.ones((2, 3)), jax.random.normal(jax.random.key(0), (5, 3, 3))
    closed = jax.make_jaxpr(jax.jit(_model))(h, ws)
    rewritten = relay_loops(closed.jaxpr)
    jcore.check_jaxpr(rewritten)

    def markers(jaxpr, is_marker):
        found = []
        for eqn in jaxpr.eqns:
            if is_marker(eqn):
                found.append(eqn)
            for v in eqn.params.values():
                if isinstance(v, jcore.ClosedJaxpr) and v.jaxpr is not jaxpr:
                    found += markers(v.jaxpr, is_marker) if eqn.primitive.name != "scan" else []
        return found

    assert len(markers(closed.jaxpr, is_relay_start)) == 2
    assert len(markers(rewritten, is_relay_start)) == 1  # only the first unit's
    (loop,) = _scans(rewritten)
    first_end = markers(rewritten, is_relay_end)[0]
    at_in = _compat.scan_carry(loop)[0] - 1  # the token carry
    assert loop.invars[at_in] is first_end.outvars[0]
    got = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(rewritten, closed.consts))(h, ws)

    def chained(h, ws):  # the same model with one token carried by hand
        token = jnp.zeros(4)
        h = h + token[0]
        token = token + h.sum()
        (h, token), _ = jax.lax.scan(_carried, (h, token), ws)
        return h * 3.0 + token[2]

    np.testing.assert_allclose(got[0], chained(h, ws), rtol=1e-6)
    assert not np.allclose(chained(h, ws), _model(h, ws))  # the chain is what changed


def test_a_loop_without_a_relay_chain_is_left_alone():
    jaxpr = jax.make_jaxpr(lambda h, ws: jax.lax.scan(lambda h, w: (h @ w, None), h, ws))(
        jnp.ones((2, 3)), jnp.ones((4, 3, 3))
    ).jaxpr
    assert relay_loops(jaxpr) is jaxpr


@pytest.fixture
def relaying(monkeypatch):
    relay_as_on_a_gpu(monkeypatch)


def _gradients(mesh, unroll):
    cfg = GPTConfig(64, seq_len=16, d_model=32, n_layers=3, n_heads=2, d_ff=64, dtype="float32")
    config = zpp.ZeroPPConfig.zero3(comm_dtype=None, unroll_layer_loops=unroll)
    model = zpp.shard(GPT(cfg, nnx.Rngs(0)), mesh, config)
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    graphdef, state = nnx.split(model)
    step = lm_gradient_step(graphdef, tokens)
    loss, grads = step(state)
    return loss, grads, step.lower(state).as_text()


def test_the_unrolled_gpt_step_equals_its_loop(mesh24, relaying):
    """The scanned GPT's step with its layer loop unrolled and relayed has
    no loop left, and its loss and gradients are the loop's (fp32, exact
    wire) to round-off; `unroll_layer_loops=False` keeps the loop."""
    loss, grads, text = _gradients(mesh24, unroll=True)
    ref_loss, ref_grads, ref_text = _gradients(mesh24, unroll=False)
    assert "stablehlo.while" in ref_text and "stablehlo.while" not in text
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_every_loop_unrolled_computes_the_same_without_a_loop():
    """`unroll_every_loop`: a scan nested in a scan and one inside a remat
    region lower with no while loop, and give the loops' values bitwise."""

    def f(ws, x):
        def inner(h, w):
            return jnp.tanh(h @ w), None

        def outer(h, _):
            return jax.lax.scan(inner, h, ws)[0], jnp.sum(h)

        h, sums = jax.lax.scan(outer, x, None, length=3)
        rematted = jax.checkpoint(lambda h: jax.lax.scan(inner, h, ws)[0])
        return {"h": rematted(h), "sums": sums}

    ws = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.3
    x = jax.random.normal(jax.random.key(1), (2, 8))
    unrolled = unroll_every_loop(f)
    assert "while" in jax.jit(f).lower(ws, x).as_text()
    assert "while" not in jax.jit(unrolled).lower(ws, x).as_text()
    want, got = jax.jit(f)(ws, x), jax.jit(unrolled)(ws, x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
