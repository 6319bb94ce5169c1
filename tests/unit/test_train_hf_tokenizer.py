"""`fxpar data prepare --tokenizer DIR` with a Hugging Face tokenizer folder, built offline here
(a byte-level BPE trained on a few sentences, saved with save_pretrained): the token files hold
the tokenizer's own ids of each document followed by its end-of-sequence id, the header names
the tokenizer and its vocabulary, `fxpar data info` prints them, and a folder that is missing or
holds no tokenizer is a one-line error."""
import zlib

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from planner.cli import main  # noqa: E402
from planner.training.data import open_data  # noqa: E402
from planner.training.prepare import prepare  # noqa: E402
from planner.training.tokenizer import HFTokenizer  # noqa: E402

SENTENCES = ["the cat sat on the mat\n", "a dog ran in the park\n",
             "def add(a, b):\n    return a + b\n", "héllo wörld, naïve café\n"]
DOCS = {"a.txt": "the cat sat on the mat, and the dog ran in the park.\n" * 6,
        "b.txt": "def add(a, b):\n    return a + b\n\nhéllo wörld: a naïve café\n" * 4}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # model_max_length below a document's length: prepare must neither truncate nor warn
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>",
                                                unk_token="<unk>", model_max_length=16)
    folder = tmp_path_factory.mktemp("hf") / "tok"
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture
def texts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text, encoding="utf-8")
    return src


def _reference(tok_dir):
    """The tokenizer itself, loaded apart from fxpar: each document's ids and the eos id."""
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    eos = ref.convert_tokens_to_ids("</s>")
    assert ref.eos_token_id == eos
    return ref, eos, {name: ref(text, add_special_tokens=False)["input_ids"] + [eos]
                      for name, text in DOCS.items()}


def test_prepare_writes_the_tokenizers_own_ids(tok_dir, texts, tmp_path):
    ref, eos, expected = _reference(tok_dir)
    assert all(len(ids) > 16 for ids in expected.values())   # past model_max_length
    out = tmp_path / "tokens"
    header = prepare([str(texts / "a.txt"), str(texts / "b.txt")], str(out),
                     tokenizer=str(tok_dir), log=lambda *_: None)
    assert header["tokenizer"] == str(tok_dir.resolve())
    assert header["vocab_size"] == len(ref) == 300 and header["eos_id"] == eos
    assert header["dtype"] == "uint16"
    # two documents: the one whose name's crc32 is smaller is the validation split
    val_name = min(DOCS, key=lambda n: zlib.crc32(n.encode()))
    train_name = next(n for n in DOCS if n != val_name)
    got = {split: np.fromfile(out / f"{split}.bin", dtype="<u2").tolist()
           for split in ("train", "val")}
    assert got == {"train": expected[train_name], "val": expected[val_name]}
    for split, name in (("train", train_name), ("val", val_name)):
        facts = header["splits"][split]
        assert facts["documents"] == 1 and facts["tokens"] == len(expected[name])
        assert facts["max_id"] == max(expected[name])
        assert ref.decode(got[split][:-1]) == DOCS[name]   # the text back, exactly
    data = open_data(str(out), verify=True)
    assert data.vocab_size == 300 and data.max_id == max(max(v) for v in expected.values())
    # fxpar's own wrapper agrees with the reference, and decodes its ids back to the text
    hf = HFTokenizer(str(tok_dir))
    assert hf.eos_id == eos and hf.vocab_size == 300
    ids = hf.encode(DOCS[train_name].encode("utf-8"))
    assert ids.tolist() == expected[train_name]
    assert hf.decode(ids[:-1]) == DOCS[train_name]


def test_the_cli_prepares_and_describes(tok_dir, texts, tmp_path, capsys):
    _, eos, expected = _reference(tok_dir)
    out = tmp_path / "cli"
    assert main(["data", "prepare", str(texts), "--out", str(out), "--tokenizer", str(tok_dir),
                 "--val-fraction", "0.5"]) == 0
    said = capsys.readouterr().out
    assert "prepared 2 files" in said and f"uint16, vocabulary 300 ({tok_dir.resolve()})" in said
    both = np.concatenate([np.fromfile(out / f"{s}.bin", dtype="<u2") for s in ("train", "val")])
    assert sorted(both.tolist()) == sorted(expected["a.txt"] + expected["b.txt"])
    assert (both == eos).sum() == 2    # one end-of-sequence per document
    assert main(["data", "info", str(out)]) == 0
    info = capsys.readouterr().out
    assert info.startswith(f"{out}: uint16 tokens, vocabulary 300 ({tok_dir.resolve()}), "
                           f"largest id ")
    assert "checksums ok" in info


def test_what_is_not_a_tokenizer_is_one_line(tok_dir, texts, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "plain.txt").write_text("x")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    cases = {tmp_path / "none": "no such folder; expected \"byte\" or a folder written by a "
                                "Hugging Face tokenizer's save_pretrained (a hub name is not "
                                "downloaded",
             tmp_path / "plain.txt": "a file, not a folder; expected \"byte\"",
             tmp_path / "empty": "not a tokenizer folder (none of tokenizer.json, "
                                 "tokenizer_config.json",
             broken: "transformers cannot load it ("}
    for folder, message in cases.items():
        with pytest.raises(ValueError) as info:
            prepare([str(texts)], str(tmp_path / "out"), tokenizer=str(folder),
                    log=lambda *_: None)
        assert message in str(info.value) and "\n" not in str(info.value)
        assert main(["data", "prepare", str(texts), "--out", str(tmp_path / "out"),
                     "--tokenizer", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fxpar: error: tokenizer ") and err.count("\n") == 1, err
        assert message in err
    assert not (tmp_path / "out" / "header.json").exists()
