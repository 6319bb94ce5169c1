"""Tokenizers for `fxpar data prepare`: the built-in byte-level one (vocabulary 256, every byte
its own token, nothing to download) or a Hugging Face tokenizer directory (what
`tokenizer.save_pretrained` writes), read locally."""
from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
    """Each byte of the file is a token id 0-255; there is no end-of-document token (the bytes
    of consecutive files follow each other, as a file ends with its own newline)."""

    name = "byte"
    vocab_size = 256
    eos_id = None

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer directory; each document ends with its end-of-sequence token when
    the tokenizer has one."""

    def __init__(self, folder: str):
        _check_folder(folder)
        try:
            import transformers
        except ImportError:
            raise ValueError("a Hugging Face tokenizer needs transformers (pip install "
                             "'fxpar[hf]'), or use --tokenizer byte") from None
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - transformers raises assorted types
            first = " ".join(str(err).split())[:300]
            raise ValueError(f"tokenizer {folder}: transformers cannot load it ({first}); "
                             f"write the folder again with the tokenizer's save_pretrained") \
                from None
        self.name = os.path.abspath(folder)
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id

    def encode(self, data: bytes) -> np.ndarray:
        ids = self.tok(data.decode("utf-8", errors="replace"), add_special_tokens=False,
                       verbose=False)["input_ids"]
        if self.eos_id is not None:
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


# what save_pretrained writes for a fast (tokenizer.json) or a slow tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
_EXPECTED = "expected \"byte\" or a folder written by a Hugging Face tokenizer's save_pretrained"


def _check_folder(folder: str) -> None:
    """A folder that exists and holds a tokenizer's files (hub names are not downloaded)."""
    if not os.path.exists(folder):
        raise ValueError(f"tokenizer {folder!r}: no such folder; {_EXPECTED} (a hub name is "
                         f"not downloaded: save its tokenizer to a folder first)")
    if not os.path.isdir(folder):
        raise ValueError(f"tokenizer {folder!r}: a file, not a folder; {_EXPECTED}")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer {folder!r}: not a tokenizer folder (none of "
                         f"{', '.join(TOKENIZER_FILES)}); {_EXPECTED}")


def load_tokenizer(spec: str):
    """"byte" or a Hugging Face tokenizer directory."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
