import numpy as np
import pytest

from zpp_jax import ByteDataset, load_text, stdlib_corpus


def test_stdlib_corpus_is_real_python():
    toks = stdlib_corpus(1 << 20)
    assert toks.dtype == np.uint8 and len(toks) == 1 << 20
    assert b"def " in toks.tobytes() and b"import " in toks.tobytes()


def _windows(batch):
    """Each row's seq_len + 1 tokens: inputs plus the last target."""
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


def test_batches_are_pure_functions_of_seed_split_index():
    # Every token is its own position in the corpus, so a window shows where it came from.
    ds = ByteDataset(np.arange(10_000, dtype=np.int64), seq_len=32, val_fraction=0.05)
    a = ds.batch("train", 7, 4, seed=0)
    np.testing.assert_array_equal(a["inputs"], ds.batch("train", 7, 4, seed=0)["inputs"])
    assert not np.array_equal(a["inputs"], ds.batch("train", 8, 4, seed=0)["inputs"])
    assert not np.array_equal(a["inputs"], ds.batch("train", 7, 4, seed=1)["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert a["inputs"].shape == (4, 32) and a["inputs"].dtype == np.int32
    for split, (lo, hi) in {"train": (0, 9500), "val": (9500, 10_000)}.items():
        w = _windows(ds.batch(split, 0, 64, seed=0))
        assert np.all(np.diff(w, axis=1) == 1)  # contiguous windows of the corpus
        assert w.min() >= lo and w.max() < hi  # from this split only


def test_held_out_split_and_errors(tmp_path):
    ds = ByteDataset(np.zeros(1000, np.uint8), seq_len=8, val_fraction=0.1)
    assert len(ds.splits["train"]) == 900 and len(ds.splits["val"]) == 100
    with pytest.raises(ValueError, match="too few for seq_len"):
        ByteDataset(np.zeros(100, np.uint8), seq_len=64)
    p = tmp_path / "t.txt"
    p.write_bytes(b"hello")
    assert load_text(p).tolist() == list(b"hello")
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_text(tmp_path / "e.txt")


def test_token_ids_outside_the_vocabulary_are_refused():
    tokens = np.arange(400, dtype=np.uint16) % 300  # ids up to 299
    with pytest.raises(ValueError, match="token id 256 at position 256 is outside the model's"):
        ByteDataset(tokens, seq_len=8, vocab_size=256)
    ByteDataset(tokens, seq_len=8, vocab_size=300)  # fits
