"""Where the engine's compile options and unit ordering come from, and the
errors of compiling for a GPU without what it needs."""

import pytest

from zpp_jax import UsageError, make_mesh, xla_flags
from zpp_jax.aot import TARGET_CONFIG_ENV, target_config
from zpp_jax.schedule import platform, prefetches


def test_cpu_mesh_compiles_in_order_with_no_options():
    mesh = make_mesh(2, 4)
    assert platform(mesh) == "cpu" and not prefetches(mesh)
    assert xla_flags(mesh) == {} and xla_flags("tpu") == {}


def test_gpu_options_turn_on_the_latency_hiding_scheduler_and_pipeliners():
    flags = xla_flags("gpu")
    assert flags["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert flags["xla_gpu_enable_pipelined_all_gather"] is True
    assert flags == xla_flags("cuda")
    flags["xla_gpu_enable_pipelined_all_gather"] = False  # a copy, not the engine's own
    assert xla_flags("gpu")["xla_gpu_enable_pipelined_all_gather"] is True


def test_unrolled_units_let_collectives_of_different_kinds_overlap():
    limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
    assert limit not in xla_flags("gpu") and xla_flags("gpu", unrolled=True)[limit] == 3
    assert xla_flags("cpu", unrolled=True) == {}


def test_unrolled_units_keep_their_permutes_apart():
    combine = "xla_gpu_collective_permute_combine_threshold_bytes"
    assert combine not in xla_flags("gpu") and xla_flags("gpu", unrolled=True)[combine] == 0


def test_stacks_are_told_from_single_layers():
    """What `Trainer` passes as `unrolled`: a stack under a layer loop keeps
    XLA's one collective in flight; units that are all single layers are
    unrolled."""
    from flax import nnx

    from zpp_jax import ZeroPPConfig, shard
    from zpp_jax.models import GPT, GPTConfig, Llama, LlamaConfig
    from zpp_jax.shard import has_stacked_units

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
