import numpy as np
import pytest

from zpp_jax import ByteDataset, load_text, stdlib_corpus


def test_stdlib_corpus_is_real_python():
    toks = stdlib_corpus(1 << 20)
    assert toks.dtype == np.uint8 and len(toks) == 1 << 20
    assert b"def " in toks.tobytes() and b"import " in toks.tobytes()


def test_batches_are_pure_functions_of_seed_split_index():
    ds = ByteDataset(np.arange(10_000, dtype=np.int64) % 256, seq_len=32)
    a = ds.batch("train", 7, 4, seed=0)
    np.testing.assert_array_equal(a["inputs"], ds.batch("train", 7, 4, seed=0)["inputs"])
    assert not np.array_equal(a["inputs"], ds.batch("train", 8, 4, seed=0)["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert a["inputs"].shape == (4, 32) and a["inputs"].dtype == np.int32
    val = ds.batch("val", 0, 64, seed=0)["inputs"]
    assert val.min() >= 0 and np.all(np.isin(val, ds.splits["val"]))


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
