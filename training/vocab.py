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

and sentences, what users send to the word-level tasks (:data:`SENTENCES`), with their own two sides:

- held out (the ``valid`` and ``test`` splits): ordinary short sentences and phrases, with capitals,
  function words ("the", "to", "and") and punctuation attached to words ("Maria drove to Lisbon.",
  "the old lighthouse keeper"); made by :func:`sentence` from fixed hand-written templates and lists
  that no training input is made from;
- training (the ``train`` split): :func:`training_sentence`, strings of the same kinds of token
  (function words, capitalised and lowercase training-side words, punctuation on a word) in random
  order, never from those templates.

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

__all__ = ["EVAL_VOCABS", "LEGACY_WORDS", "SENTENCES", "VOCABS", "draw_word", "english_words", "heldout_words",
           "is_heldout_word", "made_up", "sentence", "train_words", "training_sentence"]

LEGACY_WORDS = (
    "cat", "dog", "sun", "map", "red", "blue", "tree", "fish", "bird", "star", "moon", "rock",
    "leaf", "rain", "wind", "fire", "lake", "hill", "road", "ship", "king", "rose", "milk", "salt",
)
VOCABS = ("train", "heldout", "madeup", "legacy")
#: Inputs that are sentences: :func:`sentence` for test and valid, :func:`training_sentence` for training.
SENTENCES = "sentences"
EVAL_VOCABS = (*VOCABS, SENTENCES)
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


# --- sentences ---------------------------------------------------------------------------------

_NAMES = ("Maria", "Tom", "Aisha", "Kenji", "Olga", "Pedro", "Lena", "Sam", "Nadia", "Omar", "Ruth", "Ivan")
_PLACES = ("Lisbon", "Oslo", "Cairo", "Lima", "Dublin", "Kyoto", "Quebec", "Nairobi", "Porto", "Seoul")
_PRONOUNS = ("I", "We", "They", "She", "He", "You")
_NOUNS = ("shop", "station", "garden", "river", "library", "market", "kitchen", "office", "harbour", "bakery",
          "lighthouse", "museum", "bridge", "school", "park", "beach")
_PEOPLE = ("keeper", "teacher", "baker", "driver", "doctor", "painter", "farmer", "singer")
_ADJECTIVES = ("old", "small", "quiet", "busy", "new", "cold", "bright", "empty", "green", "tall")
_MOTION = ("went", "walked", "drove", "cycled", "hurried", "returned", "ran", "moved")
_ACTION = ("saw", "found", "painted", "cleaned", "visited", "left", "opened", "closed")
_WHEN = ("yesterday", "today", "early", "again", "later", "last night")
_TEMPLATES = (
    "{Subj} {motion} to the {noun}{end}",
    "{Name} {motion} to {Place}{end}",
    "the {adj} {noun} {person}",
    "{Subj} {action} the {adj} {noun} {when}{end}",
    "{Name} and {Name2} {action} a {noun} in {Place}{end}",
    "{Subj} {motion} home, then {subj} {action} the {noun}{end}",
    "the {noun} by the {noun2} is {adj}{end}",
    "Was the {noun} {adj} {when}?",
    "{Name}, the {person}, {action} it{end}",
    "this {adj} {noun} and that {adj2} {noun2}",
)


def sentence(rng: random.Random) -> str:
    """An ordinary sentence or phrase of 3-9 words, with the function words, capitals and punctuation
    (attached to its words, as a user types them) that a word list lacks: "Maria drove to Lisbon.",
    "the old lighthouse keeper". The held-out side: no inventory is trained on these templates."""
    def pick(words: tuple[str, ...], *avoid: str) -> str:
        while True:
            word = words[rng.randrange(len(words))]
            if word not in avoid:
                return word
    subj, name, noun, adj = pick(_PRONOUNS), pick(_NAMES), pick(_NOUNS), pick(_ADJECTIVES)
    slots = {"Subj": subj, "subj": pick(_PRONOUNS, "I").lower(), "Name": name, "Name2": pick(_NAMES, name),
             "Place": pick(_PLACES), "noun": noun, "noun2": pick(_NOUNS, noun), "person": pick(_PEOPLE),
             "adj": adj, "adj2": pick(_ADJECTIVES, adj), "motion": pick(_MOTION), "action": pick(_ACTION),
             "when": pick(_WHEN), "end": (".", ".", "!", "")[rng.randrange(4)]}
    return _TEMPLATES[rng.randrange(len(_TEMPLATES))].format(**slots)


#: The words that hold a sentence together; both sides of the sentences draw on them.
_FUNCTION_WORDS = ("the", "a", "an", "to", "and", "of", "in", "on", "at", "by", "for", "with", "from", "is",
                   "was", "it", "this", "that", "then", "but", "or", "not", "my", "your", "our", "their", "his",
                   "her", "we", "they", "she", "he", "I", "you", "home", "very", "there", "here")


def training_sentence(rng: random.Random) -> str:
    """A sentence-like string of 3-9 tokens for training: function words and training-side words
    (one in four capitalised, as names are) in random order, the first often capitalised, a comma
    on a word now and then, an end mark most of the time, a token repeated in about a third.
    ``"Then her velvet, and the lamp was Dofa."``"""
    n = rng.randrange(3, 10)
    toks = []
    for _ in range(n):
        if rng.random() < 0.4:
            toks.append(_FUNCTION_WORDS[rng.randrange(len(_FUNCTION_WORDS))])
        else:
            word = draw_word(rng, "train")
            toks.append(word.capitalize() if rng.random() < 0.25 else word)
    if rng.random() < 0.35:
        i = rng.randrange(n - 1)
        toks[rng.randrange(i + 1, n)] = toks[i]
    if rng.random() < 0.5:
        toks[0] = toks[0][:1].upper() + toks[0][1:]
    if rng.random() < 0.25:
        toks[rng.randrange(n - 1)] += ","
    toks[-1] += (".", ".", "!", "?", "")[rng.randrange(5)]
    return " ".join(toks)
