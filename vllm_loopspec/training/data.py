"""Corpus for the stdlib Ouro: the Python standard library's own ``.py`` source.

Split by file, deterministically: file ``i`` of the sorted
:func:`~vllm_loopspec.tools.tokenizer.stdlib_files` list is held out when
``i % HOLDOUT_EVERY == HOLDOUT_OFFSET`` (every 20th file), everything else
trains. The BPE tokenizer is trained on the training split only. Token ids are
computed once and cached as ``.npy`` (uint16) under a cache directory outside
git, keyed by the tokenizer's hash and the file list, so a rerun (or a
``--resume``) skips tokenisation.

Each split is one stream: every file's ids followed by ``<|endoftext|>`` (id 0).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_loopspec.tools.tokenizer import EOS_TOKEN, read_texts, stdlib_files, train_bpe

HOLDOUT_EVERY = 20
HOLDOUT_OFFSET = 10
EOS_ID = 0

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = REPO_ROOT / ".cache" / "loopspec-train"


def ensure_cache_dir(path: Path) -> Path:
    """Create ``path``; a repo-local ``.cache`` gets a ``.gitignore`` of ``*`` so
    git never sees the cached ids or training states."""
    path.mkdir(parents=True, exist_ok=True)
    for parent in [path, *path.parents]:
        if parent.name == ".cache":
            ignore = parent / ".gitignore"
            if not ignore.exists():
                ignore.write_text("*\n")
            break
    return path


def split_files(files: list[Path] | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held_out) file lists; held out = every ``HOLDOUT_EVERY``-th file."""
    files = stdlib_files() if files is None else files
    train = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY != HOLDOUT_OFFSET]
    held = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_OFFSET]
    return train, held


def _files_key(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}:{st.st_size}\n".encode())
    return h.hexdigest()[:16]


def get_tokenizer(vocab_size: int, cache_dir: Path = DEFAULT_CACHE):
    """Byte-level BPE trained on the training split (cached as tokenizer.json)."""
    from tokenizers import Tokenizer

    train, _ = split_files()
    cache_dir = ensure_cache_dir(cache_dir)
    path = cache_dir / f"tokenizer-v{vocab_size}-{_files_key(train)}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = train_bpe(read_texts(train), vocab_size)
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID, "EOS must be id 0"
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def tokenizer_hash(tok) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def encode_files(tok, files: list[Path]) -> np.ndarray:
    """One uint16 stream: each file's ids then EOS."""
    texts = list(read_texts(files))
    encs = tok.encode_batch(texts)
    parts = []
    for enc in encs:
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([EOS_ID], dtype=np.uint16))
    return np.concatenate(parts)


@dataclass
class Corpus:
    train: np.ndarray  # uint16 token stream
    held_out: np.ndarray
    tokenizer: object
    meta: dict


def load_corpus(vocab_size: int = 4096, cache_dir: Path = DEFAULT_CACHE) -> Corpus:
    """Tokenizer plus cached token streams of both splits."""
    assert vocab_size <= 65535
    os.environ.setdefault("RAYON_NUM_THREADS", "2")
    cache_dir = ensure_cache_dir(cache_dir)
    tok = get_tokenizer(vocab_size, cache_dir)
    train_files, held_files = split_files()
    key = f"v{vocab_size}-{tokenizer_hash(tok)}-{_files_key(train_files + held_files)}"
    streams = {}
    for name, files in (("train", train_files), ("held_out", held_files)):
        path = cache_dir / f"ids-{name}-{key}.npy"
        if not path.exists():
            arr = encode_files(tok, files)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, arr)
            tmp.replace(path)
        streams[name] = np.load(path)
    meta = {
        "train_files": len(train_files),
        "held_out_files": len(held_files),
        "train_tokens": int(streams["train"].size),
        "held_out_tokens": int(streams["held_out"].size),
        "train_bytes": int(sum(p.stat().st_size for p in train_files)),
        "held_out_bytes": int(sum(p.stat().st_size for p in held_files)),
        "split": f"file i of sorted stdlib_files() held out iff i % {HOLDOUT_EVERY} == {HOLDOUT_OFFSET}",
        "tokenizer_sha": tokenizer_hash(tok),
        "cache_key": key,
    }
    return Corpus(streams["train"], streams["held_out"], tok, meta)


def held_out_windows(stream: np.ndarray, length: int, count: int | None = None) -> np.ndarray:
    """Non-overlapping windows of ``length`` ids from the start of ``stream``."""
    n = stream.size // length
    if count is not None:
        n = min(n, count)
    return stream[: n * length].reshape(n, length).astype(np.int64)


if __name__ == "__main__":
    import time

    t0 = time.time()
    c = load_corpus()
    print(json.dumps(c.meta, indent=2), f"{time.time() - t0:.1f}s")
