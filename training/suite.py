"""A shipped, deterministic, procedural suite of compositional string tasks.

Inputs are short space-separated sequences (3-6 tokens) of lowercase words
and small numbers (0-20), always holding at least one word and one number,
e.g. ``"cat 7 dog cat"``. The words come from a vocabulary (:mod:`training.vocab`):
thousands of English words and made-up strings for training, others held out
for evaluation, or the first suite's 24 words (``"legacy"``). Primitive skills are pure ``str -> str`` functions
on such sequences; a task applies 1-3 of them left to right and is named by
joining the primitive names with ``.``:

>>> parse_task("rev-words.upper").apply("cat 7 dog")
'DOG 7 CAT'
>>> parse_task("inc.sum").apply("cat 7 dog 2")
'11'

:func:`build_suite` picks training and held-out tasks such that every task is
the shortest composition computing its function, no two tasks (and no task
and the identity) agree on a fixed probe set of inputs, no task is constant
there, and held-out tasks recombine primitives all seen in training.
Everything is seeded through :mod:`hashlib`, so it is identical across
processes and Python versions.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from training.data import Example, write_jsonl
from training.vocab import EVAL_VOCABS, LEGACY_WORDS, SENTENCES, draw_word, sentence, training_sentence

__all__ = [
    "PRIMITIVES", "SPLITS", "TERMINAL_PRIMITIVES", "WORD_PRIMITIVES", "Suite", "TaskSpec", "build_suite",
    "examples", "parse_task", "probe_inputs", "random_input", "suite_examples", "takes_sentences", "write_jsonl",
]

WORDS = LEGACY_WORDS
MAX_NUMBER = 20
SPLITS = ("train", "valid", "test")
N_PROBES = 50


def _seed(*parts: object) -> int:
    """A 64-bit integer seed from ``parts``, stable across processes (unlike ``hash()``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


# --- primitives: each a pure str -> str on a space-separated token sequence --------------------

def _map_tokens(text: str, fn: Callable[[str], str]) -> str:
    return " ".join(fn(t) for t in text.split())


def _map_numbers(text: str, fn: Callable[[int], int]) -> str:
    return _map_tokens(text, lambda t: str(fn(int(t))) if t.isdigit() else t)


def _shift(c: str) -> str:
    if "a" <= c <= "z":
        return chr((ord(c) - 97 + 1) % 26 + 97)
    if "A" <= c <= "Z":
        return chr((ord(c) - 65 + 1) % 26 + 65)
    return c


def rev_words(text: str) -> str:
    """Reverse the order of the tokens. ``"a b 3" -> "3 b a"``"""
    return " ".join(reversed(text.split()))


def upper(text: str) -> str:
    """Uppercase every letter. ``"cat 3" -> "CAT 3"``"""
    return text.upper()


def title(text: str) -> str:
    """Capitalize each token (first letter up, rest down). ``"cat DOG" -> "Cat Dog"``"""
    return _map_tokens(text, str.capitalize)


def sort_words(text: str) -> str:
    """Sort the tokens as strings (digits before letters). ``"dog 3 cat" -> "3 cat dog"``"""
    return " ".join(sorted(text.split()))


def dedupe(text: str) -> str:
    """Drop repeated tokens, keeping the first occurrence. ``"a b a" -> "a b"``"""
    return " ".join(dict.fromkeys(text.split()))


def first2(text: str) -> str:
    """Keep the first two tokens. ``"a b c" -> "a b"``"""
    return " ".join(text.split()[:2])


def last2(text: str) -> str:
    """Keep the last two tokens. ``"a b c" -> "b c"``"""
    return " ".join(text.split()[-2:])


def swap_ends(text: str) -> str:
    """Swap the first and the last token. ``"a b c" -> "c b a"``"""
    toks = text.split()
    if len(toks) >= 2:
        toks[0], toks[-1] = toks[-1], toks[0]
    return " ".join(toks)


def rotate(text: str) -> str:
    """Move the first token to the end. ``"a b c" -> "b c a"``"""
    toks = text.split()
    return " ".join(toks[1:] + toks[:1])


def rev_chars(text: str) -> str:
    """Reverse the letters of each word; numbers are unchanged. ``"cat 12" -> "tac 12"``"""
    return _map_tokens(text, lambda t: t if t.isdigit() else t[::-1])


def caesar(text: str) -> str:
    """Shift every letter by one (z wraps to a), keeping case. ``"cat Z" -> "dbu A"``"""
    return "".join(_shift(c) for c in text)


def plural(text: str) -> str:
    """Append ``s`` (``S`` to uppercase words) to each word; numbers are unchanged. ``"cat 3" -> "cats 3"``"""
    return _map_tokens(text, lambda t: t if t.isdigit() else t + ("S" if t.isupper() else "s"))


def inc(text: str) -> str:
    """Add one to every number. ``"cat 3" -> "cat 4"``"""
    return _map_numbers(text, lambda n: n + 1)


def double(text: str) -> str:
    """Double every number. ``"cat 3" -> "cat 6"``"""
    return _map_numbers(text, lambda n: 2 * n)


def count(text: str) -> str:
    """The number of tokens (terminal). ``"a b 3" -> "3"``"""
    return str(len(text.split()))


def sum_numbers(text: str) -> str:
    """The sum of the numbers, 0 if none (terminal). ``"a 2 b 5" -> "7"``"""
    return str(sum(int(t) for t in text.split() if t.isdigit()))


PRIMITIVES: dict[str, Callable[[str], str]] = {
    "rev-words": rev_words, "upper": upper, "title": title, "sort": sort_words, "dedupe": dedupe,
    "first2": first2, "last2": last2, "swap-ends": swap_ends, "rotate": rotate,
    "rev-chars": rev_chars, "caesar": caesar, "plural": plural, "inc": inc, "double": double,
    "count": count, "sum": sum_numbers,
}
#: Primitives whose output is a single number; they may only come last in a composition.
TERMINAL_PRIMITIVES = frozenset({"count", "sum"})
#: Primitives that move, select or case whole words: the ones a sentence is a sensible input to.
WORD_PRIMITIVES = frozenset({"rev-words", "title", "first2", "last2", "swap-ends", "rotate", "dedupe", "sort"})


def takes_sentences(task: TaskSpec) -> bool:
    """Whether ``task`` is a composition of word-level primitives only, so that a sentence
    (vocab ``"sentences"``) is an input it makes sense on; a number or spelling task is not.

    >>> takes_sentences(parse_task("rev-words.title")), takes_sentences(parse_task("rev-words.inc"))
    (True, False)
    """
    return set(task.primitives) <= WORD_PRIMITIVES


@dataclass(frozen=True)
class TaskSpec:
    """A task: primitives applied left to right; ``name`` is them joined with ``.``."""

    name: str
    primitives: tuple[str, ...]

    def apply(self, text: str) -> str:
        for p in self.primitives:
            text = PRIMITIVES[p](text)
        return text

    def describe(self) -> str:
        """A human-readable description built from the primitives' docstrings."""
        return "; then ".join((PRIMITIVES[p].__doc__ or p).split(". ")[0] for p in self.primitives)


def parse_task(name: str) -> TaskSpec:
    """The task called ``name`` (e.g. ``"inc.rev-words"``); ``ValueError`` if not a valid composition."""
    prims = tuple(name.split("."))
    unknown = [p for p in prims if p not in PRIMITIVES]
    if unknown or not 1 <= len(prims) <= 3:
        raise ValueError(f"{name!r} is not a composition of 1-3 known primitives (unknown: {unknown})")
    if any(p in TERMINAL_PRIMITIVES for p in prims[:-1]):
        raise ValueError(f"{name!r}: {sorted(TERMINAL_PRIMITIVES)} may only come last")
    return TaskSpec(name, prims)


# --- inputs -------------------------------------------------------------------------------------

def random_input(rng: random.Random, vocab: str = "train") -> str:
    """A 3-6 token input with at least one word (of ``vocab``) and one number; ~40% repeat a token.
    With ``vocab="sentences"``, a sentence instead (:func:`training.vocab.sentence`)."""
    if vocab == SENTENCES:
        return sentence(rng)
    while True:
        n = rng.randrange(3, 7)
        toks = [draw_word(rng, vocab) if rng.random() < 0.6 else str(rng.randrange(MAX_NUMBER + 1))
                for _ in range(n)]
        if rng.random() < 0.4:
            i = rng.randrange(n - 1)
            toks[rng.randrange(i + 1, n)] = toks[i]
        if any(t.isdigit() for t in toks) and not all(t.isdigit() for t in toks):
            return " ".join(toks)


def _split_of(text: str) -> str:
    """The split an input belongs to (80/10/10 by hash), so splits never share an input."""
    bucket = _seed("split", text) % 10
    return "train" if bucket < 8 else ("valid" if bucket == 8 else "test")


def probe_inputs(n: int = N_PROBES) -> list[str]:
    """A fixed set of distinct inputs used to tell task functions apart (on the legacy words, so the
    suite's tasks stay the ones every inventory was trained and measured on)."""
    rng = random.Random(_seed("probe"))
    out: dict[str, None] = {}
    while len(out) < n:
        out[random_input(rng, "legacy")] = None
    return list(out)


def examples(task: TaskSpec, n: int, seed: int, split: str = "train", vocab: str = "train") -> list[Example]:
    """``n`` examples of ``task`` with words of ``vocab``, deterministic in ``(task.name, seed, split, vocab)``.

    A smaller ``n`` gives a prefix of a larger one; inputs are distinct within
    a call where possible; the splits draw from disjoint sets of inputs. Training
    suites use ``vocab="train"``, and ``"sentences"`` for the word-level tasks (:func:`takes_sentences`);
    ``"heldout"`` and ``"madeup"`` words are for few-shot and test inputs (:mod:`training.vocab`).
    Sentences of the training split are :func:`training.vocab.training_sentence`, those of the
    others the held-out templates of :func:`training.vocab.sentence`.

    >>> ex = examples(parse_task("upper"), 2, seed=0, split="test")
    >>> len(ex), all(e.output == e.input.upper() for e in ex)
    (2, True)
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if vocab not in EVAL_VOCABS:
        raise ValueError(f"vocab must be one of {EVAL_VOCABS}, got {vocab!r}")
    if vocab == SENTENCES and not takes_sentences(task):
        raise ValueError(f"{task.name!r} is not made of word-level primitives only: sentences are no input to it")
    # the legacy vocabulary keeps the seeds, and so the exact examples, of the first suite
    rng = random.Random(_seed("examples", task.name, seed, split) if vocab == "legacy"
                        else _seed("examples", task.name, seed, split, vocab))
    seen: set[str] = set()
    out: list[Example] = []
    budget = 200 * n + 1000
    while len(out) < n:
        text = training_sentence(rng) if vocab == SENTENCES and split == "train" else random_input(rng, vocab)
        if _split_of(text) != split:
            continue
        budget -= 1
        if text in seen and budget > 0:
            continue
        seen.add(text)
        out.append(Example(task.name, text, task.apply(text)))
    return out


def suite_examples(tasks: Iterable[TaskSpec], n_per_task: int, seed: int, split: str = "train",
                   vocab: str = "train") -> list[Example]:
    """:func:`examples` for each task in turn, concatenated."""
    return [ex for t in tasks for ex in examples(t, n_per_task, seed, split, vocab)]


# --- the suite ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Suite:
    """Training tasks (adapters are trained on these) and held-out compositions of the same primitives."""

    seed: int
    train_tasks: list[TaskSpec]
    heldout_tasks: list[TaskSpec]

    @property
    def all_tasks(self) -> list[TaskSpec]:
        return self.train_tasks + self.heldout_tasks

    def task(self, name: str) -> TaskSpec:
        for t in self.all_tasks:
            if t.name == name:
                return t
        raise KeyError(name)


def _candidates() -> list[TaskSpec]:
    """All valid compositions of 1-3 primitives, shortest first, in a fixed order."""
    names = list(PRIMITIVES)
    out = []
    for k in (1, 2, 3):
        for prims in itertools.product(names, repeat=k):
            if not any(p in TERMINAL_PRIMITIVES for p in prims[:-1]):
                out.append(TaskSpec(".".join(prims), prims))
    return out


@functools.cache
def candidate_pool() -> tuple[TaskSpec, ...]:
    """Every composition a suite draws from: the first (shortest) for its probe signature, neither
    identity nor constant."""
    probes = probe_inputs()
    seen = {tuple(probes)}  # the identity function
    out = []
    for t in _candidates():
        sig = tuple(t.apply(x) for x in probes)
        if sig not in seen and len(set(sig)) > 1:
            seen.add(sig)
            out.append(t)
    return tuple(out)


def build_suite(seed: int = 0, n_pairs: tuple[int, int] = (20, 8), n_triples: tuple[int, int] = (12, 8),
                exclude: frozenset[str] = frozenset()) -> Suite:
    """Pick the suite: train = every primitive alone + ``n_pairs[0]`` pairs + ``n_triples[0]`` triples;
    held-out = ``n_pairs[1]`` pairs + ``n_triples[1]`` triples (48 and 16 tasks by default).
    Compositions named in ``exclude`` (another held-out set) are passed over for training; the draws
    are otherwise unchanged, so a suite that drew none of them is the same without ``exclude``.

    >>> s = build_suite()
    >>> len(s.train_tasks), len(s.heldout_tasks)
    (48, 16)
    """
    pool = candidate_pool()
    singles = [t for t in pool if len(t.primitives) == 1]
    if len(singles) != len(PRIMITIVES):
        raise AssertionError("a primitive is degenerate on the probe set")
    rng = random.Random(_seed("suite", seed))
    train, held = list(singles), []
    for k, (n_train, n_held) in ((2, n_pairs), (3, n_triples)):
        bucket = [t for t in pool if len(t.primitives) == k]
        rng.shuffle(bucket)
        held += bucket[:n_held]
        train += [t for t in bucket[n_held:] if t.name not in exclude][:n_train]
    return Suite(seed=seed, train_tasks=train, heldout_tasks=held)
