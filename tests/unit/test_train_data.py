"""Token folders (planner.training.data, planner.training.prepare): what `fxpar data prepare`
writes, one-line errors for a missing or corrupt folder and for ids past the model's
vocabulary, and batches that are a pure function of (seed, step), each data-parallel rank
reading only its own rows."""
import json
import os

import numpy as np
import pytest

from planner.training.data import DataError, dtype_for, open_data, unigram_entropy
from planner.training.prepare import prepare

TEXT = "def add(a, b):\n    return a + b\n\n" * 40


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(30):
        (src / "pkg" / f"m{i}.py").write_text(f"# module {i}\n" + TEXT * (1 + i % 3))
    (src / "notes.bin").write_bytes(b"\x00\x01")  # not matched by the patterns
    out = tmp_path / "tokens"
    header = prepare([str(src)], str(out), val_fraction=0.1, log=lambda *_: None)
    return out, header


def test_prepare_writes_flat_uint16_files_and_a_header(corpus):
    out, header = corpus
    assert header["dtype"] == "uint16" and header["vocab_size"] == 256
    assert header["tokenizer"] == "byte"
    train, val = header["splits"]["train"], header["splits"]["val"]
    assert train["documents"] + val["documents"] == 30 and val["documents"] >= 1
    ids = np.fromfile(out / "train.bin", dtype="<u2")
    assert len(ids) == train["tokens"] and ids.max() == train["max_id"] < 128
    assert os.path.getsize(out / "val.bin") == 2 * val["tokens"]
    data = open_data(str(out), verify=True)
    assert data.splits["train"].unigram_entropy == pytest.approx(train["unigram_entropy"])
    # the same files give the same split and bytes again
    again = prepare([str(out.parent / "src")], str(out.parent / "again"), val_fraction=0.1,
                    log=lambda *_: None)
    assert again["splits"] == header["splits"]


def test_dtype_and_entropy():
    assert dtype_for(256).name == "uint16" and dtype_for(65536).name == "uint16"
    assert dtype_for(65537).name == "uint32" and dtype_for(200_000).itemsize == 4
    assert unigram_entropy(np.array([5, 5])) == pytest.approx(np.log(2))
    assert unigram_entropy(np.array([7, 0, 0])) == 0.0


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
    data = open_data(str(corpus[0]))
    a = data.train_offsets(0, 5, 8, 16)
    assert np.array_equal(a, open_data(str(corpus[0])).train_offsets(0, 5, 8, 16))
    assert not np.array_equal(a, data.train_offsets(0, 6, 8, 16))
    assert not np.array_equal(a, data.train_offsets(1, 5, 8, 16))
    assert a.min() >= 0 and a.max() <= data.splits["train"].tokens - 16 - 1
    x, y = data.rows("train", a, 16)
    assert x.shape == (8, 16) and np.array_equal(x[:, 1:], y[:, :-1])  # targets: next tokens
    # each data-parallel rank's rows are those rows of the global batch
    for dp in (1, 2, 4):
        parts = [data.rows("train", a[d * 8 // dp: (d + 1) * 8 // dp], 16)[0] for d in range(dp)]
        assert np.array_equal(np.concatenate(parts), x)
    v = data.val_offsets(1, 8, 16)
    assert np.array_equal(v, data.val_offsets(1, 8, 16)) and v.max() < data.splits["val"].tokens


def test_missing_and_corrupt_folders_are_one_line(corpus, tmp_path):
    out, header = corpus

    def fails(folder, verify=False) -> str:
        with pytest.raises(DataError) as info:
            open_data(str(folder), verify=verify)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "does not exist; write it with `fxpar data prepare" in fails(tmp_path / "none")
    assert "has no header.json" in fails(tmp_path / "src")
    with open(out / "val.bin", "r+b") as f:   # flip one byte: only the checksum sees it
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 1]))
    open_data(str(out))
    assert "val.bin is corrupt: its crc32 is" in fails(out, verify=True)
    with open(out / "train.bin", "r+b") as f:
        f.truncate(10)
    assert "train.bin is corrupt: 10 bytes, the header says" in fails(out)
    os.remove(out / "train.bin")
    assert "train.bin is missing (the header's train split)" in fails(out)
    (out / "header.json").write_text("{not json")
    assert "header.json is corrupt: not JSON" in fails(out)
    (out / "header.json").write_text(json.dumps({**header, "version": 9}))
    assert "has version 9" in fails(out)


def test_ids_past_the_vocabulary_and_short_splits(corpus):
    data = open_data(str(corpus[0]))
    top = data.max_id
    data.check_fits(top + 1, 16, 8)
    with pytest.raises(DataError, match=rf"token id {top} is past the model's vocabulary of "
                                        rf"{top} \(ids 0-{top - 1}\)"):
        data.check_fits(top, 16, 8)
    with pytest.raises(DataError, match="fewer than one sequence"):
        data.check_fits(256, 10**7, 8)


def test_prepare_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(DataError, match="input .* does not exist"):
        prepare([str(tmp_path / "none")], str(tmp_path / "out"), log=lambda *_: None)
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="no input file matches"):
        prepare([str(tmp_path)], str(tmp_path / "out"), log=lambda *_: None)
    with pytest.raises(ValueError, match='expected "byte" or a folder'):
        prepare([str(tmp_path)], str(tmp_path / "out"), tokenizer="gpt2-nope",
                log=lambda *_: None)
    one = tmp_path / "one.txt"   # a single document: its tail is the validation split
    one.write_text("hello world\n" * 100)
    header = prepare([str(one)], str(tmp_path / "single"), val_fraction=0.1,
                     log=lambda *_: None)
    assert header["splits"]["val"]["tokens"] == 120 and header["splits"]["train"]["tokens"] == 1080
