"""Where the engine's compile options and unit ordering come from, and the
errors of compiling for a GPU without what it needs."""

import pytest

from zpp_jax import LinkModel, Trainer, UsageError, make_mesh
from zpp_jax.analysis.target import TARGET_CONFIG_ENV, target_config
from zpp_jax.overlap import overlap_options, platform, prefetches
from zpp_jax.overlap.links import collective_costs


def test_cpu_mesh_compiles_in_order_with_no_options():
    mesh = make_mesh(2, 4)
    assert platform(mesh) == "cpu" and not prefetches(mesh)
    assert overlap_options(mesh) == {} and overlap_options("tpu") == {}


def test_gpu_options_turn_on_the_latency_hiding_scheduler_and_pipeliners():
    flags = overlap_options("gpu")
    assert flags["xla_gpu_enable_latency_hiding_scheduler"] is True
    on = "COLLECTIVE_PIPELINING_MODE_ON"
    assert [flags[f"xla_gpu_pipeline_{kind}"] for kind in KINDS] == [on] * 3
    assert flags == overlap_options("cuda")
    flags["xla_gpu_pipeline_all_gather"] = "COLLECTIVE_PIPELINING_MODE_OFF"  # a copy
    assert overlap_options("gpu")["xla_gpu_pipeline_all_gather"] == on


KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def test_this_jaxlib_accepts_every_option_the_engine_compiles_with(recwarn):
    """Checked against the installed XLA, not assumed: a compile with all of
    them succeeds, and none was left out (which would warn)."""
    import jax

    options = overlap_options("gpu", unrolled=True)
    assert len(options) == 8
    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((2,), "float32"))
    lowered.compile(options)
    assert [str(w.message) for w in recwarn] == []


def test_unrolled_units_let_collectives_of_different_kinds_overlap():
    limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
    assert limit not in overlap_options("gpu") and overlap_options("gpu", unrolled=True)[limit] == 3
    assert overlap_options("cpu", unrolled=True) == {}


def test_unrolled_units_keep_their_permutes_apart():
    combine = "xla_gpu_collective_permute_combine_threshold_bytes"
    assert (
        combine not in overlap_options("gpu")
        and overlap_options("gpu", unrolled=True)[combine] == 0
    )


def test_stacks_are_told_from_single_layers():
    """What `Trainer` passes as `unrolled`: a stack under a layer loop keeps
    XLA's one collective in flight; units that are all single layers are
    unrolled."""
    from flax import nnx

    from zpp_jax import ZeroPPConfig, shard
    from zpp_jax.models import GPT, GPTConfig, Llama, LlamaConfig
    from zpp_jax.sharded import has_stacked_units

    mesh = make_mesh(2, 4)
    gpt = GPT(GPTConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32), nnx.Rngs(0))
    llama = Llama(LlamaConfig.preset("tiny", n_layers=2), nnx.Rngs(0))
    assert has_stacked_units(shard(gpt, mesh, ZeroPPConfig()))
    assert not has_stacked_units(shard(llama, mesh, ZeroPPConfig()))


def test_target_description_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(TARGET_CONFIG_ENV, raising=False)
    with pytest.raises(UsageError, match=TARGET_CONFIG_ENV):
        target_config()
    with pytest.raises(UsageError, match="does not exist"):
        target_config(tmp_path / "missing.txtpb")
    bad = tmp_path / "bad.txtpb"
    bad.write_text("not a target\n")
    with pytest.raises(UsageError, match="not an XLA GPU target description"):
        target_config(bad)
    good = tmp_path / "h200.txtpb"
    good.write_text(
        "gpu_device_info {\n  threads_per_block_limit: 1024\n}\ncollective_memory_granularity: 4\n"
    )
    monkeypatch.setenv(TARGET_CONFIG_ENV, str(good))
    text = target_config()
    assert "gpu_device_info" in text and "collective_memory_granularity" not in text


# Two collectives of a scheduled GPU program, as `compiled.as_text()` prints
# them: qgZ's all-to-all inside node 0 and 1 (groups of 4), and its permute
# across the nodes, known to the scheduler by another name.
_A2A = (
    "  %a2a = ((u8[4,1000]{1,0}), u8[4,1000]{1,0}) all-to-all-start(%p), "
    "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, "
    'metadata={scheduling_name="all-to-all-start.3"}'
)
_PERMUTE = (
    "  %cp = (u8[2000]{0}, u8[2000]{0}) collective-permute-start(%q), "
    "source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}, "
    'metadata={scheduling_name="collective-permute-start.9"}'
)
_HLO = "\n".join(
    [
        "ENTRY %main (p: u8[4,1000]) -> u8[2000] {",
        _A2A,
        "  %a2a-done = u8[4,1000]{1,0} all-to-all-done(%a2a)",
        _PERMUTE,
        "  ROOT %cp-done = u8[2000]{0} collective-permute-done(%cp)",
        "}",
    ]
)


def test_collectives_are_costed_on_the_links_they_cross():
    """The latency profile the scheduler reads: each collective under its
    scheduling name, at the link model's latency plus one device's bytes
    (the ring model's) over the link it crosses; nothing else."""
    links = LinkModel(intra_node_gbps=300.0, cross_node_gbps=50.0, latency_us=20.0)
    profile = collective_costs(_HLO, 4, links)
    assert profile.splitlines() == [
        # 3/4 of 4,000 bytes over NVLink at 300 GB/s
        'costs { name: "all-to-all-start.3" cost_us: 20.010 }',
        # 2,000 bytes to the other node at 50 GB/s
        'costs { name: "collective-permute-start.9" cost_us: 20.040 }',
    ]
    assert links.cost_us(50e9 * 1e-6, True) == pytest.approx(21.0)  # 1 us of the NIC


@pytest.mark.parametrize("field", ["intra_node_gbps", "cross_node_gbps", "latency_us"])
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "fast", True])
def test_link_model_refuses_what_is_not_a_positive_finite_number(field, bad):
    with pytest.raises(UsageError, match=f"LinkModel.{field} must be a positive finite number"):
        LinkModel(**{field: bad})


def test_a_trainer_takes_a_link_model_or_none(mesh24):
    import optax
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match="links must be a zpp.LinkModel or None"):
        Trainer(model, optax.sgd(0.1), mesh24, links={"cross_node_gbps": 50})
