"""`fxpar data prepare TEXT... --out DIR`: tokenize text files into the token folder `fxpar
train` reads (planner.training.data): train.bin, val.bin and header.json.

Inputs are files or folders (searched recursively, in sorted order, for the --include
patterns). Each file is one document. The validation split holds the documents whose path's
crc32 falls in the first `val_fraction` of its range (at least one document when there are two
or more), so the same files give the same split on every machine; a single document is cut
instead, its last `val_fraction` of tokens held out. The files are written document by document
(memory stays one document), then the header, last, which makes the folder readable.
"""
from __future__ import annotations

import fnmatch
import os
import time
import zlib

import numpy as np

from planner.training.data import (FORMAT, VERSION, DataError, dtype_for, write_header,
                                   file_facts, unigram_entropy)
from planner.training.tokenizer import load_tokenizer

DEFAULT_INCLUDE = ("*.txt", "*.md", "*.rst", "*.py")


def find_files(inputs: list[str], include: tuple[str, ...] = DEFAULT_INCLUDE,
               exclude: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(path, name) of every input file, sorted; name is the path below the input folder (what
    decides the split, so the split does not depend on where the folder lies)."""
    found: list[tuple[str, str]] = []
    for given in inputs:
        if os.path.isfile(given):
            found.append((given, os.path.basename(given)))
        elif os.path.isdir(given):
            for root, dirs, files in os.walk(given):
                dirs.sort()
                for name in sorted(files):
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, given)
                    if (any(fnmatch.fnmatch(name, p) for p in include)
                            and not any(fnmatch.fnmatch(rel, p) for p in exclude)
                            and os.path.isfile(path)):
                        found.append((path, rel))
        else:
            raise DataError(f"input {given} does not exist (give text files or folders of them)")
    if not found:
        raise DataError(f"no input file matches {', '.join(include)} under "
                        f"{', '.join(inputs)}")
    return found


def is_validation(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) < val_fraction * 2**32


def prepare(inputs: list[str], out: str, tokenizer: str = "byte", val_fraction: float = 0.01,
            include: tuple[str, ...] = DEFAULT_INCLUDE, exclude: tuple[str, ...] = (),
            max_bytes: int = 0, log=print) -> dict:
    """Tokenize `inputs` into `out`; returns the header written."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction: expected a number in (0, 1), got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    files = find_files(inputs, include, exclude)
    if max_bytes:
        kept, total = [], 0
        for path, name in files:
            if total >= max_bytes:
                break
            kept.append((path, name))
            total += os.path.getsize(path)
        files = kept
    val = {name for _, name in files if is_validation(name, val_fraction)}
    if len(files) >= 2 and not val:      # the document whose hash is smallest
        val = {min((name for _, name in files), key=lambda n: zlib.crc32(n.encode()))}
    if len(files) >= 2 and len(val) == len(files):
        val.discard(max(val, key=lambda n: zlib.crc32(n.encode())))
    dtype = dtype_for(tok.vocab_size)
    os.makedirs(out, exist_ok=True)
    header_path = os.path.join(out, "header.json")
    if os.path.exists(header_path):
        os.remove(header_path)  # the folder is unreadable until the new header is written
    start, read = time.perf_counter(), 0
    counts = {"train": 0, "val": 0}
    with open(os.path.join(out, "train.bin"), "wb") as train_f, \
            open(os.path.join(out, "val.bin"), "wb") as val_f:
        for path, name in files:
            with open(path, "rb") as f:
                data = f.read()
            read += len(data)
            ids = tok.encode(data)
            if len(ids) and int(ids.max()) > np.iinfo(dtype).max:
                raise DataError(f"{path}: token id {int(ids.max())} does not fit {dtype.name}")
            ids = ids.astype(dtype)
            if len(files) == 1:  # one document: its tail is the validation split
                cut = len(ids) - max(1, int(len(ids) * val_fraction))
                ids[:cut].tofile(train_f)
                ids[cut:].tofile(val_f)
                counts = {"train": 1, "val": 1}
                continue
            split = "val" if name in val else "train"
            ids.tofile(val_f if split == "val" else train_f)
            counts[split] += 1
    splits = {}
    for split in ("train", "val"):
        file = os.path.join(out, f"{split}.bin")
        facts = file_facts(file, dtype)
        if facts["tokens"] == 0:
            raise DataError(f"the {split} split of {', '.join(inputs)} is empty: give more "
                            f"text")
        splits[split] = {"file": f"{split}.bin", "tokens": int(facts["tokens"]),
                         "crc32": int(facts["crc32"]), "max_id": int(facts["max_id"]),
                         "documents": counts[split],
                         "unigram_entropy": unigram_entropy(facts["counts"])}
    header = {"format": FORMAT, "version": VERSION, "dtype": dtype.name,
              "vocab_size": int(tok.vocab_size), "tokenizer": tok.name,
              "eos_id": tok.eos_id, "val_fraction": val_fraction, "source_bytes": read,
              "splits": splits}
    write_header(out, header)
    took = time.perf_counter() - start
    log(f"prepared {len(files)} files ({read / 1e6:.1f} MB) into {out} in {took:.1f} s: train "
        f"{splits['train']['tokens']:,} tokens ({counts['train']} documents), validation "
        f"{splits['val']['tokens']:,} tokens ({counts['val']} documents); {dtype.name}, "
        f"vocabulary {tok.vocab_size} ({'byte-level' if tok.name == 'byte' else tok.name})")
    log(f"unigram entropy: train {splits['train']['unigram_entropy']:.4f} nats, validation "
        f"{splits['val']['unigram_entropy']:.4f} nats per token")
    return header


def describe(folder: str) -> str:
    """`fxpar data info DIR`: what a token folder holds (and that its files are intact)."""
    from planner.training.data import open_data
    data = open_data(folder, verify=True)
    lines = [f"{folder}: {data.dtype.name} tokens, vocabulary {data.vocab_size} "
             f"({data.header.get('tokenizer')}), largest id {data.max_id}, checksums ok"]
    for s in data.splits.values():
        lines.append(f"  {s.name:5s} {s.tokens:>14,} tokens  {s.documents:>7} documents  "
                     f"unigram entropy {s.unigram_entropy:.4f} nats")
    return "\n".join(lines)


def cmd_data(args) -> int:
    if args.data_command == "prepare":
        include = tuple(p.strip() for p in args.include.split(",") if p.strip())
        exclude = tuple(p.strip() for p in (args.exclude or "").split(",") if p.strip())
        prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, include, exclude,
                args.max_bytes)
        return 0
    print(describe(args.folder))
    return 0
