"""The open vocabulary (training/vocab.py): held-out words never reach a training input."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from training import vocab as vocab_module
from training.suite import WORD_PRIMITIVES, build_suite, examples, parse_task, rev_words, takes_sentences
from training.trainer import NAMED_SUITES, suite_tasks
from training.vocab import (
    LEGACY_WORDS,
    SENTENCES,
    VOCABS,
    draw_word,
    english_words,
    heldout_words,
    is_heldout_word,
    train_words,
)

ROOT = Path(__file__).resolve().parents[2]
# The held-out English words, pinned: a change of the word list or of the split rule changes what
# "held-out" means for every figure measured on it, so it must be a deliberate change of this test.
HELDOUT_COUNT, HELDOUT_SHA256 = 1858, "59e40f3fac173a1e"


def words_of(text: str) -> list[str]:
    return [t for t in text.split() if not t.isdigit()]


def test_the_held_out_word_list_is_pinned_and_disjoint_from_the_training_words():
    held, train = heldout_words(), train_words()
    assert len(held) == HELDOUT_COUNT
    assert hashlib.sha256("\n".join(held).encode()).hexdigest()[:16] == HELDOUT_SHA256
    assert not set(held) & set(train)
    assert set(held) | set(train) == set(english_words())
    assert len(english_words()) > 5000  # thousands of words, not a lookup table
    assert set(LEGACY_WORDS) <= set(train)  # the old inventory saw them: they can never be "held out"


def test_every_training_suite_input_is_free_of_held_out_and_made_up_held_out_words():
    """The leak test: the named suite and the wide suite's JSONL (scripts/wide_suite.py) draw
    training inputs from the training side only."""
    seen = 0
    for exs in suite_tasks("procedural", 60, seed=0).values():
        for ex in exs:
            for w in words_of(ex.input):
                assert not is_heldout_word(w), (ex.task, ex.input)
                seen += 1
    assert seen > 48 * 60  # every task drew words
    for task in build_suite(0, n_pairs=(103, 8), n_triples=(381, 8)).train_tasks[::25]:
        for ex in examples(task, 40, seed=0, split="train", vocab="train"):
            assert not any(is_heldout_word(w) for w in words_of(ex.input)), (ex.task, ex.input)


def test_the_wide_suite_script_writes_no_held_out_word(tmp_path):
    out = tmp_path / "suite.jsonl"
    subprocess.run([sys.executable, "-m", "scripts.wide_suite", "--pairs", "20", "--triples", "12",
                    "--examples-per-task", "30", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 48 * 30
    assert not [r["input"] for r in rows if any(is_heldout_word(w) for w in words_of(r["input"]))]
    assert len({w for r in rows for w in words_of(r["input"])} - set(LEGACY_WORDS)) > 300


@pytest.mark.parametrize("vocab", ["heldout", "madeup"])
def test_held_out_vocabularies_draw_only_held_out_strings(vocab):
    task = build_suite(0).heldout_tasks[0]
    words = [w for ex in examples(task, 100, seed=0, split="test", vocab=vocab) for w in words_of(ex.input)]
    assert words and all(is_heldout_word(w) for w in words)
    english = set(english_words())
    if vocab == "heldout":
        assert set(words) <= set(heldout_words())
    else:
        assert not set(words) & english  # made-up strings are no English word of the list


def test_training_draws_mix_english_and_made_up_strings_and_legacy_keeps_its_24_words():
    rng = random.Random(0)
    drawn = [draw_word(rng, "train") for _ in range(2000)]
    english = set(english_words())
    made_up = [w for w in drawn if w not in english]
    assert 0.2 < len(made_up) / len(drawn) < 0.4
    assert {draw_word(rng, "legacy") for _ in range(500)} == set(LEGACY_WORDS)
    with pytest.raises(ValueError, match="vocab"):
        draw_word(rng, "klingon")
    with pytest.raises(ValueError, match="vocab"):
        examples(build_suite(0).train_tasks[0], 1, seed=0, vocab="klingon")


def test_the_legacy_vocabulary_reproduces_the_first_suites_examples():
    """Older figures stay comparable: the same inputs as before the open vocabulary (pinned)."""
    exs = examples(build_suite(0).heldout_tasks[0], 3, seed=1000, split="train", vocab="legacy")
    assert all(set(words_of(e.input)) <= set(LEGACY_WORDS) for e in exs)
    digest = hashlib.sha256(json.dumps([(e.input, e.output) for e in exs]).encode()).hexdigest()[:16]
    assert digest == LEGACY_DIGEST


def test_named_suites():
    assert set(NAMED_SUITES) == {"procedural", "procedural24"} and set(NAMED_SUITES.values()) <= set(VOCABS)
    legacy = suite_tasks("procedural24", 20, seed=0)
    assert all(set(words_of(e.input)) <= set(LEGACY_WORDS) for exs in legacy.values() for e in exs)
    open_ = suite_tasks("procedural", 20, seed=0)
    assert legacy.keys() == open_.keys() and len(legacy) == 48
    assert {w for exs in open_.values() for e in exs for w in words_of(e.input)} - set(LEGACY_WORDS)


LEGACY_DIGEST = "af21d4e8de2762d2"  # computed with the suite before the open vocabulary


# -- sentences: the word-level tasks' inputs, held-out templates and training sentences ---------

FUNCTION_WORDS = {"the", "to", "and", "a", "by", "in", "then", "is", "this", "that", "it"}


def test_sentences_are_ordinary_sentences_with_function_words_and_punctuation():
    exs = examples(parse_task("rev-words"), 200, seed=0, split="test", vocab=SENTENCES)
    tokens = [t for e in exs for t in e.input.split()]
    assert len({e.input for e in exs}) > 150 and all(3 <= len(e.input.split()) <= 9 for e in exs)
    assert sum(t.lower().strip(",.!?") in FUNCTION_WORDS for t in tokens) / len(tokens) > 0.15
    assert any(t[-1] in ",.!?" for t in tokens) and any(t[:1].isupper() for t in tokens)
    assert not any(t.isdigit() for t in tokens)  # no numbers: a sentence is for the word-level tasks
    assert all(e.output == rev_words(e.input) for e in exs)
    again = examples(parse_task("rev-words"), 200, seed=0, split="test", vocab=SENTENCES)
    assert again == exs and examples(parse_task("title"), 20, seed=0, split="test", vocab=SENTENCES) != exs[:20]


def test_training_sentences_are_made_of_training_words_never_of_the_held_out_templates():
    train = examples(parse_task("rev-words"), 300, seed=0, split="train", vocab=SENTENCES)
    test = examples(parse_task("rev-words"), 300, seed=0, split="test", vocab=SENTENCES)
    assert all(e.output == rev_words(e.input) for e in train) and not {e.input for e in train} & {e.input for e in test}
    tokens = [t.strip(",.!?") for e in train for t in e.input.split()]
    assert all(3 <= len(e.input.split()) <= 9 for e in train) and not any(t.isdigit() for t in tokens)
    function_words = {w.lower() for w in vocab_module._FUNCTION_WORDS}
    assert sum(t.lower() in function_words for t in tokens) / len(tokens) > 0.3
    content = [t.lower() for t in tokens if t.lower() not in function_words]
    assert content and not any(is_heldout_word(w) for w in content)  # the held-out words stay held out
    assert any(t[:1].isupper() for t in tokens) and any(e.input[-1] in ".!?" for e in train)


def test_sentences_are_refused_for_tasks_that_are_not_word_level():
    with pytest.raises(ValueError, match="word-level"):
        examples(parse_task("rev-words.inc"), 4, seed=0, split="test", vocab=SENTENCES)


def test_only_word_level_tasks_take_sentences():
    assert WORD_PRIMITIVES == {"rev-words", "title", "first2", "last2", "swap-ends", "rotate", "dedupe", "sort"}
    assert takes_sentences(parse_task("sort.title.rotate")) and takes_sentences(parse_task("dedupe"))
    assert not any(takes_sentences(parse_task(t)) for t in ("inc", "rev-words.count", "title.caesar", "upper"))


def test_eval_measures_sentences_on_word_level_tasks_only(tmp_path):
    from click.testing import CliRunner

    from tests.support.server_fixtures import build_store
    from training.cli import eval_cmd

    build_store(tmp_path / "store", tasks=("rev-words", "inc", "title.sort"))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(eval_cmd, ["--store", str(tmp_path / "store"), "--tasks", "rev-words,inc,title.sort",
                                           "--n", "2", "--vocabs", "heldout,sentences", "--backbone", "tiny",
                                           "--json-out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["tasks"]
    assert set(rows["rev-words"]["by_vocab"]) == set(rows["title.sort"]["by_vocab"]) == {"heldout", "sentences"}
    assert set(rows["inc"]["by_vocab"]) == {"heldout"}
    only = CliRunner().invoke(eval_cmd, ["--store", str(tmp_path / "store"), "--tasks", "inc", "--n", "2",
                                         "--vocabs", "sentences", "--backbone", "tiny"], catch_exceptions=False)
    assert only.exit_code == 0 and "skip inc: no word-level task" in only.output
