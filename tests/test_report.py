import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from zpp_jax.analysis import collectives_in_hlo, summarize
from zpp_jax.lowlevel import AXES, LOCAL, NODE

HLO = """\
HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[8]{0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %ar = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
}

%cond (p: (s32[], f32[8])) -> pred[] {
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %rs = bf16[2]{0} reduce-scatter(%y), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %cp = u8[16]{0} collective-permute(%z), channel_id=4, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}, metadata={op_name="ppermute"}
}
"""  # noqa: E501


def test_parses_groups_trip_counts_and_ring_bytes():
    ag, ar, rs, cp = collectives_in_hlo(HLO)
    assert ag.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and not ag.spans_nodes(4)
    assert ar.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and ar.spans_nodes(4)
    assert (ag.runs, ar.runs, rs.runs) == (6, 6, 1)
    assert ag.moved_bytes == 32 * 3 / 4  # (g-1)/g of the gathered buffer
    assert ar.moved_bytes == 2 * 32 * 1 / 2  # all-reduce: 2(g-1)/g
    assert rs.moved_bytes == 4 * 4 * 3 / 4  # reduce-scatter: of the full input
    assert cp.groups == ((0, 4), (4, 0), (1, 5), (5, 1)) and cp.spans_nodes(4)
    assert cp.moved_bytes == 16  # a permute: its whole buffer
    summary = summarize(HLO, 4)
    assert summary.cross_node_bytes == 6 * 32 + 16
    assert summary.intra_node_bytes == 6 * 24 + 12


def test_real_program(mesh24):
    def f(x):
        x = jax.lax.all_gather(x, LOCAL, tiled=True)
        return jax.lax.psum(x, NODE)

    hlo = (
        jax.jit(jax.shard_map(f, mesh=mesh24, in_specs=P(AXES), out_specs=P(NODE), check_vma=False))
        .lower(jnp.ones(80))
        .compile()
        .as_text()
    )
    kinds = {c.kind: c for c in collectives_in_hlo(hlo)}
    assert kinds["all-gather"].group_size == 4 and not kinds["all-gather"].spans_nodes(4)
    assert kinds["all-reduce"].group_size == 2 and kinds["all-reduce"].spans_nodes(4)
    assert kinds["all-reduce"].result_bytes == 40 * 4


@pytest.mark.slow  # a compiled step's every collective; the byte counts stay in the loop
def test_each_collective_names_its_unit(mesh24):
    """A unit's call runs under its own named scope, so every collective of
    its gathers and reductions, forward and backward, says which unit it
    belongs to; `exposed_by_unit` groups them per unit and kind (on CPU
    nothing runs behind a GEMM, so that is every one)."""
    import optax
    from flax import nnx

    from zpp_jax import Trainer, ZeroPPConfig
    from zpp_jax.analysis import step_report
    from zpp_jax.analysis.report import exposed_by_unit, unit_of
    from zpp_jax.models import GPT, GPTConfig

    cfg = GPTConfig.preset("tiny", seq_len=16, dtype="float32")
    trainer = Trainer(GPT(cfg, nnx.Rngs(0)), optax.adamw(1e-3), mesh24, ZeroPPConfig())
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    report = step_report(trainer, {"inputs": tokens, "targets": tokens})
    engine = [c for c in report["collectives"] if c["region"] in ("gather", "reduce")]
    assert {c["unit"] for c in engine} == {"embed", "blocks", "head"}
    assert {c["kind"] for c in report["collectives"] if not c["unit"]} == {"all-reduce"}
    by_unit = exposed_by_unit(report["collectives"])
    layers = cfg.n_layers  # the stack's loop runs each of its collectives once per layer
    assert by_unit["blocks"] == {
        "all-gather gather": 3 * layers,  # hpZ: node then local forward, local backward
        "all-to-all reduce": layers,
        "collective-permute reduce": layers,
    }
    assert by_unit["embed"] == {
        "all-gather gather": 2,  # no backward gather: the embedding's gradient needs no weight
        "all-to-all reduce": 1,
        "collective-permute reduce": 1,
    }
    assert unit_of("jit(f)/transpose(jvp(zpp_unit[layers/3]))/shard_map/x") == "layers/3"
    assert unit_of("jit(f)/reduce_sum") == ""
