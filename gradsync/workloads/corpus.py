"""Text for the language models: the Python standard library's own source, read once per process.

The corpus is every *.py file under sysconfig's stdlib path (third-party site-packages left out, so
that it does not depend on what is installed), in sorted path order, decoded as UTF-8 with errors
replaced and concatenated up to a number of characters. It differs between Python versions; on one
interpreter it is the same on every run and every rank.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator

import torch

# Character tokens are the ASCII codes; every other character becomes NUL, which never occurs in
# source text, so the vocabulary stays at 128.
CHAR_VOCAB = 128
NON_ASCII_TOKEN = 0
# Words: identifiers and numbers, or any single other non-space character (punctuation).
WORD_PATTERN = re.compile(r"\w+|[^\w\s]")
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@functools.lru_cache(maxsize=1)
def stdlib_paths() -> tuple[str, ...]:
    """Every standard-library *.py file, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    if not paths:
        raise FileNotFoundError(f"no *.py files under the standard library path {root!r}")
    return tuple(sorted(paths))


def stdlib_texts(num_chars: int) -> Iterator[str]:
    """The decoded files in order, the last one cut, so that they total `num_chars` characters
    (fewer, with a warning, where the standard library is shorter)."""
    remaining = num_chars
    for path in stdlib_paths():
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        yield text[:remaining]
        remaining -= min(len(text), remaining)
        if remaining == 0:
            return
    warnings.warn(
        f"corpus_chars={num_chars:,} is more than the standard library holds; using all "
        f"{num_chars - remaining:,} characters",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=2)
def char_tokens(num_chars: int) -> torch.Tensor:
    """The corpus as one uint8 token per character (see CHAR_VOCAB). Do not modify it: it is cached."""
    return encode_chars(stdlib_texts(num_chars))


@functools.lru_cache(maxsize=2)
def word_tokens(num_chars: int, vocab_size: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    """encode_words of the corpus. Do not modify the ids: they are cached."""
    return encode_words(stdlib_texts(num_chars), vocab_size)


def encode_chars(texts: Iterable[str]) -> torch.Tensor:
    """The texts concatenated, one uint8 token per character: the ASCII code, or NON_ASCII_TOKEN."""
    # Encoded text by text: one joined str would take 4 bytes per character as soon as a single
    # character lies outside the Basic Multilingual Plane.
    encoded = bytearray(b"".join(text.encode("utf-8") for text in texts))
    if not encoded:
        return torch.empty(0, dtype=torch.uint8)
    # One pass over bytes instead of a Python loop per character: in UTF-8 every character has
    # exactly one byte that is not a continuation byte (0b10xxxxxx); ASCII characters are their
    # own byte, and the lead byte of any other character is >= 0xC0.
    raw = torch.frombuffer(encoded, dtype=torch.uint8)
    tokens = raw[(raw < 0x80) | (raw >= 0xC0)]
    tokens[tokens >= CHAR_VOCAB] = NON_ASCII_TOKEN
    return tokens


def encode_words(texts: Iterable[str], vocab_size: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    """(ids, words): the texts split by WORD_PATTERN, each word as its rank by frequency (ties
    broken alphabetically) among the vocab_size - 1 most frequent; every rarer word is
    vocab_size - 1, <unk>. ids are int32, to be cast per batch; words[i] is the word of id i,
    for the (at most vocab_size - 1) kept words."""
    words = [w for text in texts for w in WORD_PATTERN.findall(text)]
    counts = Counter(words)
    kept = sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - 1]
    index = {w: i for i, w in enumerate(kept)}
    unk = vocab_size - 1
    ids = torch.tensor([index.get(w, unk) for w in words], dtype=torch.int32)
    return ids, tuple(kept)
