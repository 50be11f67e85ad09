"""The words procedural task inputs are drawn from: training words, held-out words, made-up words.

An inventory that only ever sees a few words learns a lookup table of them, not the operation
(``upper`` of a word it never saw). So the open-vocabulary suite draws inputs from thousands of
English words (training/words/english.txt, made by scripts/word_list.py) and from made-up letter
strings (names, codes and typos are what users send), and one fixed rule splits every string into
a training side and a held-out side:

- ``train``: the strings inventories are trained on (real and made-up);
- ``heldout``: English words never in any training input;
- ``madeup``: made-up strings never in any training input;
- ``legacy``: the 24 words of the first suite, kept so older inventories can be compared on it.

The split is a hash of the string itself, so it holds for every string ever generated, in any
process, and a test can check any input against it (:func:`is_heldout_word`). The legacy words are
always on the training side: the old inventory saw them.

>>> is_heldout_word("cat")
False
>>> all(is_heldout_word(w) for w in heldout_words()[:5])
True
"""

from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path

__all__ = ["LEGACY_WORDS", "VOCABS", "draw_word", "english_words", "heldout_words", "is_heldout_word",
           "made_up", "train_words"]

LEGACY_WORDS = (
    "cat", "dog", "sun", "map", "red", "blue", "tree", "fish", "bird", "star", "moon", "rock",
    "leaf", "rain", "wind", "fire", "lake", "hill", "road", "ship", "king", "rose", "milk", "salt",
)
VOCABS = ("train", "heldout", "madeup", "legacy")
#: One string in HELDOUT_BUCKETS of every N_BUCKETS is held out.
N_BUCKETS, HELDOUT_BUCKETS = 5, 1
#: Share of the training side's draws that are made-up strings (the rest are English words).
MADE_UP_SHARE = 0.3
_WORDS_FILE = Path(__file__).resolve().parent / "words" / "english.txt"

_VOWELS = "aeiou"
_CONSONANTS = "bcdfghjklmnprstvwz"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _bucket(word: str) -> int:
    return int.from_bytes(hashlib.sha256(b"word-split\x1f" + word.encode()).digest()[:8], "big") % N_BUCKETS


def is_heldout_word(word: str) -> bool:
    """Whether ``word`` is on the held-out side: it may appear in test and few-shot inputs, never in training."""
    return word not in LEGACY_WORDS and _bucket(word) < HELDOUT_BUCKETS


@functools.cache
def english_words() -> tuple[str, ...]:
    """The committed English word list (lowercase, 3-8 letters), sorted."""
    return tuple(w for w in _WORDS_FILE.read_text().split() if w)


@functools.cache
def train_words() -> tuple[str, ...]:
    return tuple(w for w in english_words() if not is_heldout_word(w))


@functools.cache
def heldout_words() -> tuple[str, ...]:
    return tuple(w for w in english_words() if is_heldout_word(w))


@functools.cache
def _english_set() -> frozenset[str]:
    return frozenset(english_words())


def made_up(rng: random.Random) -> str:
    """A made-up lowercase string of 3-8 letters that is not an English word of the list: two in three
    pronounceable ("dofa", "kifal"), one in three a code-like jumble ("xqzt")."""
    while True:
        if rng.random() < 2 / 3:
            word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) + ("" if rng.random() < 0.6 else
                           rng.choice(_CONSONANTS)) for _ in range(rng.randrange(1, 4)))
        else:
            word = "".join(rng.choice(_LETTERS) for _ in range(rng.randrange(3, 7)))
        if 3 <= len(word) <= 8 and word not in _english_set():
            return word


def draw_word(rng: random.Random, vocab: str) -> str:
    """One word of ``vocab`` (see the module docstring)."""
    if vocab == "legacy":
        return LEGACY_WORDS[rng.randrange(len(LEGACY_WORDS))]
    if vocab == "heldout":
        words = heldout_words()
        return words[rng.randrange(len(words))]
    if vocab == "train":
        if rng.random() >= MADE_UP_SHARE:
            words = train_words()
            return words[rng.randrange(len(words))]
        held = False
    elif vocab == "madeup":
        held = True
    else:
        raise ValueError(f"vocab must be one of {VOCABS}, got {vocab!r}")
    while True:  # the hash keeps one string in N_BUCKETS on the held-out side
        word = made_up(rng)
        if is_heldout_word(word) == held:
            return word
