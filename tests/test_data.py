import dataclasses
import math
import re
import shutil

import corpora
import numpy as np
import pytest

import zpp_jax as zpp
from zpp_jax.data import (
    BatchLoader,
    TokenDataset,
    TokenFiles,
    load_text,
    local_rows,
    make_tokenizer,
    stdlib_corpus,
    train_bpe,
)
from zpp_jax.recipes import RunConfig, corpus, run


def test_stdlib_corpus_is_real_python():
    toks = stdlib_corpus(1 << 20)
    assert toks.dtype == np.uint8 and len(toks) == 1 << 20
    assert b"def " in toks.tobytes() and b"import " in toks.tobytes()


def _windows(batch):
    """Each row's seq_len + 1 tokens: inputs plus the last target."""
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


def test_batches_are_pure_functions_of_seed_split_index():
    # Every token is its own position in the corpus, so a window shows where it came from.
    ds = TokenDataset(np.arange(10_000, dtype=np.int64), seq_len=32, val_fraction=0.05)
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
    ds = TokenDataset(np.zeros(1000, np.uint8), seq_len=8, val_fraction=0.1)
    assert len(ds.splits["train"]) == 900 and len(ds.splits["val"]) == 100
    with pytest.raises(ValueError, match="too few for seq_len"):
        TokenDataset(np.zeros(100, np.uint8), seq_len=64)
    p = tmp_path / "t.txt"
    p.write_bytes(b"hello")
    assert load_text(p).tolist() == list(b"hello")
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_text(tmp_path / "e.txt")


def test_token_ids_outside_the_vocabulary_are_refused():
    tokens = np.arange(400, dtype=np.uint16) % 300  # ids up to 299
    with pytest.raises(
        ValueError, match="token id 256 at position 256 is outside the vocabulary of 256"
    ):
        TokenDataset(tokens, seq_len=8, vocab_size=256)
    TokenDataset(tokens, seq_len=8, vocab_size=300)  # fits


# -- tokenizers, token files, the loader ------------------------------------------


def test_bpe_training_is_deterministic(tmp_path):
    """The same text gives the same tokenizer (its JSON byte for byte), of N
    ids; it encodes losslessly, and its ids' byte lengths add up to the
    text's bytes (bits per byte divide by those)."""
    text = corpora.text()
    a, b = train_bpe(text, 400), train_bpe(text, 400)
    assert a.to_json() == b.to_json() and a.vocab_size == 400
    assert a.fingerprint() == b.fingerprint()
    ids = a.encode(text)
    assert ids.dtype == np.uint16 and len(ids) < len(text) / 2  # merges happened
    assert a.tok.decode(ids.tolist()) == text.decode()
    assert int(a.token_bytes[ids].sum()) == len(text)
    assert train_bpe(corpora.text(seed=1), 400).to_json() != a.to_json()


def _token_files(tmp_path, train, val):
    """Train ids as a .bin split in two files and as a uint32 .npy; the
    validation ids as a .bin and a .npy."""
    folder = tmp_path / "bins"
    folder.mkdir()
    cut = len(train) // 3
    train[:cut].astype(np.uint16).tofile(folder / "a.bin")
    train[cut:].astype(np.uint16).tofile(folder / "b.bin")
    val.astype(np.uint16).tofile(tmp_path / "val.bin")
    np.save(tmp_path / "train.npy", train.astype(np.uint32))
    np.save(tmp_path / "val.npy", val.astype(np.uint32))
    return [
        (str(folder), str(tmp_path / "val.bin")),
        (str(folder / "*.bin"), str(tmp_path / "val.bin")),
        (str(tmp_path / "train.npy"), str(tmp_path / "val.npy")),
    ]


def test_token_files_give_the_text_paths_batches(tmp_path):
    """A corpus tokenized with a BPE (its train and validation parts), saved
    as nanoGPT .bin files (two for train) and as .npy: `zpp train`'s data
    (--data DIR, GLOB or FILE.npy, --val-data, --tokenizer the saved
    tokenizer.json) gives the same train and validation batches as the text
    file with --tokenizer bpe:N, read through memory maps."""
    text_file = corpora.write(tmp_path / "text")
    cfg = RunConfig(data=str(text_file), tokenizer="bpe:400", seq_len=32)
    from_text = corpus.load(cfg)
    tok = tmp_path / "tokenizer.json"
    from_text.tokenizer.save(tok)
    want = from_text.dataset(32, 400)
    for data, val in _token_files(tmp_path, from_text.train, from_text.val):
        got = corpus.load(dataclasses.replace(cfg, data=data, val_data=val, tokenizer=str(tok)))
        assert isinstance(got.train, TokenFiles)
        assert all(isinstance(p, np.memmap) for p in got.train.parts)
        ds = got.dataset(32, 400)
        for split in ("train", "val"):
            assert len(ds.splits[split]) == len(want.splits[split])
            for index in (0, 5):
                a, b = ds.batch(split, index, 8, 0), want.batch(split, index, 8, 0)
                np.testing.assert_array_equal(a["inputs"], b["inputs"])
                np.testing.assert_array_equal(a["targets"], b["targets"])


def test_rows_of_a_batch_are_the_full_batchs_rows():
    """`rows=` reads only those rows, equal to the full batch's there (what
    each process of a multi-host run reads); the loader's batches are the
    dataset's, on the mesh, from any start."""
    ds = TokenDataset(np.arange(10_000, dtype=np.int64), seq_len=16)
    full = ds.batch("train", 3, 8, seed=0)
    part = ds.batch("train", 3, 8, seed=0, rows=[4, 5, 6, 7])
    np.testing.assert_array_equal(part["inputs"][4:], full["inputs"][4:])
    assert not part["inputs"][:4].any()
    mesh = zpp.make_mesh(2, 4)
    sharding = zpp.batch_sharding(mesh)
    assert local_rows(sharding, (8, 16)) == list(range(8))
    loader = BatchLoader(ds, "train", 8, 0, sharding, start=3, stop=5)
    got = [np.asarray(b["inputs"]) for b in loader]
    assert len(got) == 2
    np.testing.assert_array_equal(got[0], full["inputs"])
    np.testing.assert_array_equal(got[1], ds.batch("train", 4, 8, seed=0)["inputs"])


def test_bits_per_byte_follow_the_tokenizer():
    """Bytes per token of the validation split: 1 for bytes, the mean byte
    length of its ids for a BPE; bits per byte = nats per token / ln 2 /
    bytes per token."""
    text = corpora.text()
    ds = TokenDataset(np.frombuffer(text, np.uint8), seq_len=16)
    assert corpus.bytes_per_token(ds, make_tokenizer("byte")) == 1.0
    bpe = train_bpe(text, 400)
    ids = bpe.encode(text)
    ds = TokenDataset(ids, seq_len=16)
    val = ids[int(len(ids) * 0.95) :]
    per = corpus.bytes_per_token(ds, bpe)
    assert per == pytest.approx(bpe.token_bytes[val].sum() / len(val)) and per > 2
    assert corpus.bits_per_byte(math.log(2) * 3.0, per) == pytest.approx(3.0 / per)


def test_bad_data_is_named(tmp_path):
    """A missing path, an empty corpus, an id outside the vocabulary, a .bin
    of an odd number of bytes, a token file of the wrong dtype, BPE on token
    files, a malformed --tokenizer: each names the file and the problem."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "e.txt").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.save(tmp_path / "f.npy", np.zeros(100, np.float32))
    big = tmp_path / "big.bin"
    np.array([1, 2, 300, 4] * 100, np.uint16).tofile(big)
    small = tmp_path / "small.txt"
    small.write_text("def f(x):\n    return x + 1\n" * 20)
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.txt")
    binary = tmp_path / "random.bin.txt"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    cases = [
        (dict(data=str(loop)), r"loop: a loop of symbolic links, it reaches no file"),
        (dict(data=str(tmp_path / "dangling")), r"dangling: a symbolic link to .*gone.txt, which"),
        (
            dict(data=str(binary), tokenizer="bpe:300"),
            r"random.bin.txt: 0% of its 5,000 bytes are NUL|random.bin.txt: not UTF-8 text, from "
            r"byte \d+ .*: --tokenizer bpe:300 reads text; pass --accept-binary",
        ),
        (dict(data=str(tmp_path / "nope.txt")), r"--data .*nope.txt: no such file or directory"),
        (dict(data=str(empty)), "the directory holds no files"),
        (dict(data=str(tmp_path / "*.zzz")), "the pattern matches no file"),
        (dict(data=str(tmp_path / "e.txt")), r"e.txt: the corpus is empty"),
        (dict(data=str(tmp_path / "odd.bin")), r"odd.bin: 3 bytes is not a whole number of uint16"),
        (dict(data=str(tmp_path / "f.npy")), r"f.npy: a token file is a 1-D array of uint16"),
        (dict(data=str(big)), r"token id 300 at .*big.bin, position 2 is outside the vocabulary"),
        (dict(data=str(big), tokenizer="bpe:500"), "trains on text, and --data"),
        (dict(tokenizer="bpe:100"), "N must be an integer from 257 to 262,144"),
        (dict(data=str(small), tokenizer="bpe:2000"), r"bytes makes at most \d+ merges; use bpe:N"),
        (dict(tokenizer="nope.json"), "--tokenizer nope.json: no such file"),
        (dict(tokenizer=str(tmp_path / "e.txt")), r"e.txt: not a tokenizers tokenizer.json"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            run(RunConfig(steps=1, progress=False, seq_len=8, **kw))


@pytest.mark.slow  # training runs
def test_resume_refuses_another_tokenizer(tmp_path):
    """The checkpoints keep their tokenizer (tokenizer.json in --ckpt-dir);
    resuming with another one is refused, naming that file: a BPE of
    another size, bytes, another tokenizer.json. The saved one resumes, bit
    for bit where a run never stopped goes."""
    text = corpora.write(tmp_path / "text")
    ckpt = tmp_path / "ckpt"
    base = RunConfig(
        data=str(text),
        tokenizer="bpe:300",
        seq_len=8,
        batch=8,
        steps=2,
        eval_every=0,
        eval_batches=1,
        ckpt_dir=str(ckpt),
        ckpt_every=1,
        progress=False,
    )
    straight = run(base)
    shutil.rmtree(ckpt / "2")  # as if stopped after checkpoint 1
    saved = ckpt / "tokenizer.json"
    other = tmp_path / "other.json"
    train_bpe(corpora.text(seed=1), 300).save(other)
    resume = dataclasses.replace(base, resume=True)
    for tokenizer, message in [
        ("bpe:400", r"bpe:400 does not match .*tokenizer.json, the BPE of 300 ids"),
        ("byte", r"byte does not match .*tokenizer.json, the tokenizer the checkpoints"),
        (str(other), r"other.json does not match .*tokenizer.json"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(dataclasses.replace(resume, tokenizer=tokenizer))
    resumed = run(dataclasses.replace(resume, tokenizer=str(saved)))
    assert [r["step"] for r in resumed] == [2]
    for key in ("loss", "grad_norm", "val_loss", "val_bpb"):  # bit for bit
        assert resumed[0][key] == straight[1][key], key


def test_data_that_is_not_text_is_named_with_its_offset(tmp_path):
    """Under the byte tokenizer, bytes that are not text train with a
    warning naming the file and where the text ends (NULs: how many);
    --accept-binary silences it. Under a BPE they are refused (above)."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 10)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"abc\0" * 100)
    for path, want in (
        (latin, r"latin1.txt: not UTF-8 text, from byte 3 \(b'\\xe9 au'\)"),
        (nul, r"nul.txt: 25% of its 400 bytes are NUL \(a binary file\?\); training on its bytes"),
    ):
        warned = []
        corpus.load(RunConfig(data=str(path), progress=False), warned.append)
        assert len(warned) == 1 and re.search(want, warned[0]), warned
        warned.clear()
        corpus.load(RunConfig(data=str(path), accept_binary=True, progress=False), warned.append)
        assert warned == []
    warned = []
    text = tmp_path / "utf8.txt"
    text.write_text("na\u00efve caf\u00e9\n" * 10)
    corpus.load(RunConfig(data=str(text), progress=False), warned.append)
    assert warned == []


def test_a_bpe_with_an_end_of_sequence_token_keeps_it_whole():
    """`train_bpe(..., special_tokens=["<eos>"])`: "<eos>" is id 0, one id
    wherever it appears, stands for no bytes, and the other ids are the
    same tokens as without it, one further on."""
    text = b"add two and three: 5 " * 20
    plain, with_eos = train_bpe(text, 280), train_bpe(text, 281, special_tokens=["<eos>"])
    ids = with_eos.encode_text("add two<eos>add", special=True)
    assert list(ids).count(0) == 1 and with_eos.token_bytes[0] == 0
    assert with_eos.decode(ids) == "add twoadd"
    np.testing.assert_array_equal(
        with_eos.encode_text("add three"), plain.encode_text("add three") + 1
    )
