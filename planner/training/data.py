"""Token files for `fxpar train`: a flat binary of token ids per split (uint16 when the vocabulary
fits, else uint32; the nanoGPT / Megatron layout) and a small JSON header, read by np.memmap.

    DIR/header.json   {"format": "fxpar-tokens", "version": 1, "dtype": "uint16",
                       "vocab_size": 256, "tokenizer": "byte",
                       "splits": {"train": {"file": "train.bin", "tokens": N, "crc32": C,
                                            "max_id": M, "unigram_entropy": H, "documents": D},
                                  "val": {...}}}
    DIR/train.bin     N token ids, little-endian, nothing else
    DIR/val.bin       the held-out validation split

The batch of training step N (1-based) is a pure function of (seed, N): the global batch's B
windows of seq + 1 tokens start at offsets drawn from a generator seeded by (seed, N); row i is
the window at offset i, inputs its first seq tokens and targets the next seq. Each data-parallel
rank reads only its own rows (the plan gives rank d rows [d·B/dp, (d+1)·B/dp)), so a resume
at step N reads exactly what an uninterrupted run reads, under any plan. Validation batch k is
the same on every evaluation: consecutive windows from the start of the validation split.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass

import numpy as np

FORMAT, VERSION, HEADER = "fxpar-tokens", 1, "header.json"
SPLITS = ("train", "val")
_CHUNK = 1 << 24  # tokens per chunk when checking a file


class DataError(ValueError):
    """A token folder that is missing, corrupt, or does not fit the model; one line."""


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32; little-endian on every machine."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the tokens' frequencies: the loss of the best model that ignores
    context, which a trained model's validation loss must fall clearly below."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def file_facts(path: str, dtype: np.dtype) -> dict:
    """crc32, largest id, count of each id and the number of tokens of a token file."""
    ids = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
    crc, top, counts = 0, -1, np.zeros(0, dtype=np.int64)
    for start in range(0, len(ids), _CHUNK):
        part = np.asarray(ids[start: start + _CHUNK])
        crc = zlib.crc32(part.tobytes(), crc)
        top = max(top, int(part.max()))
        counts = _add(counts, np.bincount(part))
    return {"crc32": crc, "max_id": top, "counts": counts, "tokens": len(ids)}


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if len(a) < len(b):
        a, b = b, a
    a = a.copy()
    a[: len(b)] += b
    return a


@dataclass(frozen=True)
class Split:
    name: str
    path: str
    tokens: int
    crc32: int
    max_id: int
    unigram_entropy: float
    documents: int

    def open(self, dtype: np.dtype) -> np.ndarray:
        return np.memmap(self.path, dtype=dtype, mode="r")


class TokenData:
    """A prepared token folder, opened for reading: `header`, `splits`, the memmaps."""

    def __init__(self, folder: str, header: dict, splits: dict[str, Split]):
        self.folder, self.header, self.splits = folder, header, splits
        self.dtype = np.dtype(header["dtype"]).newbyteorder("<")
        self.vocab_size = int(header["vocab_size"])
        self._maps: dict[str, np.ndarray] = {}

    @property
    def max_id(self) -> int:
        return max(s.max_id for s in self.splits.values())

    def ids(self, split: str) -> np.ndarray:
        if split not in self._maps:
            self._maps[split] = self.splits[split].open(self.dtype)
        return self._maps[split]

    # -- checks ---------------------------------------------------------------------------------
    def check_fits(self, model_vocab: int, seq: int, global_batch: int) -> None:
        """Token ids inside the model's vocabulary, and each split long enough for a window."""
        if self.max_id >= model_vocab:
            raise DataError(f"{self.folder}: token id {self.max_id} is past the model's "
                            f"vocabulary of {model_vocab} (ids 0-{model_vocab - 1}); give the "
                            f"model a vocabulary of at least {self.max_id + 1} or prepare the "
                            f"data with its tokenizer")
        for split in self.splits.values():
            if split.tokens < seq + 1:
                raise DataError(f"{self.folder}: the {split.name} split has {split.tokens} "
                                f"tokens, fewer than one sequence of {seq} + 1; prepare more "
                                f"text or lower [training] seq")

    def verify(self) -> None:
        """Each split's checksum and largest id against the header (reads every file once)."""
        for split in self.splits.values():
            facts = file_facts(split.path, self.dtype)
            if facts["crc32"] != split.crc32:
                raise DataError(f"{split.path} is corrupt: its crc32 is {facts['crc32']}, the "
                                f"header says {split.crc32}; prepare the data again")
            if facts["max_id"] != split.max_id:
                raise DataError(f"{split.path} is corrupt: its largest token id is "
                                f"{facts['max_id']}, the header says {split.max_id}")

    # -- batches --------------------------------------------------------------------------------
    def train_offsets(self, seed: int, step: int, global_batch: int, seq: int) -> np.ndarray:
        """Where the B windows of training step `step` start: a pure function of (seed, step)."""
        high = self.splits["train"].tokens - seq  # the last window ends at the last token
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step])))
        return gen.integers(0, high, size=global_batch, dtype=np.int64)

    def val_offsets(self, index: int, global_batch: int, seq: int) -> np.ndarray:
        """Validation batch `index`: consecutive windows from the split's start (wrapping)."""
        high = self.splits["val"].tokens - seq
        rows = np.arange(index * global_batch, (index + 1) * global_batch, dtype=np.int64)
        return (rows * seq) % high

    def rows(self, split: str, offsets: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int64 [len(offsets), seq]: the windows at `offsets`."""
        ids = self.ids(split)
        windows = np.stack([ids[o: o + seq + 1] for o in offsets.tolist()]).astype(np.int64)
        return windows[:, :-1], windows[:, 1:]


def _read_header(folder: str) -> dict:
    path = os.path.join(folder, HEADER)
    if not os.path.isdir(folder):
        raise DataError(f"data folder {folder} does not exist; write it with `fxpar data "
                        f"prepare TEXT... --out {folder}`")
    try:
        with open(path, encoding="utf-8") as f:
            header = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{folder} has no {HEADER}: not a folder written by `fxpar data "
                        f"prepare`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is corrupt: not JSON ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path} is not an fxpar token header (format {FORMAT!r} expected)")
    if header.get("version") != VERSION:
        raise DataError(f"{path} has version {header.get('version')!r}; this fxpar reads "
                        f"version {VERSION}: prepare the data again")
    if header.get("dtype") not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype must be uint16 or uint32, got {header.get('dtype')!r}")
    if not isinstance(header.get("vocab_size"), int) or header["vocab_size"] < 1:
        raise DataError(f"{path}: vocab_size must be a positive integer")
    return header


def open_data(folder: str, verify: bool = False) -> TokenData:
    """Open and check a token folder: the header, each split's file and its size (and with
    verify, its checksum and largest id). Every problem is a DataError of one line."""
    header = _read_header(folder)
    path = os.path.join(folder, HEADER)
    dtype = np.dtype(header["dtype"]).newbyteorder("<")
    splits = {}
    for name in SPLITS:
        entry = (header.get("splits") or {}).get(name)
        keys = ("file", "tokens", "crc32", "max_id")
        if not isinstance(entry, dict) or any(k not in entry for k in keys):
            raise DataError(f"{path}: split {name!r} is missing or lacks one of "
                            f"{', '.join(keys)}")
        file = os.path.join(folder, entry["file"])
        if not os.path.isfile(file):
            raise DataError(f"{file} is missing (the header's {name} split)")
        size, want = os.path.getsize(file), entry["tokens"] * dtype.itemsize
        if size != want:
            raise DataError(f"{file} is corrupt: {size} bytes, the header says {entry['tokens']}"
                            f" {dtype.name} tokens ({want} bytes)")
        splits[name] = Split(name, file, int(entry["tokens"]), int(entry["crc32"]),
                             int(entry["max_id"]), float(entry.get("unigram_entropy", math.nan)),
                             int(entry.get("documents", 0)))
    data = TokenData(folder, header, splits)
    if verify:
        data.verify()
    return data


def write_split(folder: str, name: str, ids: np.ndarray, documents: int, dtype: np.dtype) -> dict:
    """Write one split's file; its header entry."""
    file = f"{name}.bin"
    arr = np.ascontiguousarray(ids, dtype=dtype)
    arr.tofile(os.path.join(folder, file))
    facts = file_facts(os.path.join(folder, file), dtype)
    return {"file": file, "tokens": int(facts["tokens"]), "crc32": int(facts["crc32"]),
            "max_id": int(facts["max_id"]), "documents": documents,
            "unigram_entropy": unigram_entropy(facts["counts"])}


def write_header(folder: str, header: dict) -> str:
    path = os.path.join(folder, HEADER)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(header, f, indent=1)
    os.replace(path + ".tmp", path)
    return path
