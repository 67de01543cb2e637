"""A checkpoint's `CheckpointConfig` as the library's Llama-family model
(`zpp_jax.models.Llama`)."""

from __future__ import annotations

from zpp_jax.errors import UsageError
from zpp_jax.hf.config import CheckpointConfig
from zpp_jax.models.llama import LlamaConfig


def llama_config(
    cfg: CheckpointConfig, seq_len: int | None = None, dtype: str = "float32", scan: bool = False
) -> LlamaConfig:
    """The `LlamaConfig` of the model `cfg` describes, computing in `dtype`
    on sequences of `seq_len` tokens (default: the checkpoint's longest, or its
    attention window if that is shorter).

    Raises:
      UsageError: `seq_len` beyond the checkpoint's positions
        (``max_position_embeddings``) or its attention window (its sliding
        window, which the model does not implement).
    """
    if seq_len is None:
        seq_len = min(cfg.max_positions, cfg.sliding_window or cfg.max_positions)
    if seq_len > cfg.max_positions:
        raise UsageError(
            f"sequences of {seq_len} tokens reach past this {cfg.family} checkpoint's "
            f"{cfg.max_positions} positions (max_position_embeddings): use a sequence length "
            f"of at most {cfg.max_positions}"
        )
    if cfg.sliding_window is not None and seq_len > cfg.sliding_window:
        raise UsageError(
            f"this {cfg.family} checkpoint attends within a window of {cfg.sliding_window} "
            f"tokens, and sequences of {seq_len} would reach past it: use a sequence length "
            f"of at most {cfg.sliding_window}"
        )
    rope = cfg.rope
    scaling = None
    if rope.type == "llama3":
        scaling = (
            rope.factor,
            rope.low_freq_factor,
            rope.high_freq_factor,
            rope.original_max_position,
        )
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        seq_len=seq_len,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        d_ff=cfg.d_ff,
        rope_theta=rope.theta,
        dtype=dtype,
        scan=scan,
        norm_eps=cfg.norm_eps,
        head_size=cfg.head_dim,
        qkv_bias=cfg.qkv_bias,
        tie_embeddings=cfg.tie_embeddings,
        rope_scaling=scaling,
    )
