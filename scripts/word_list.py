"""Write the open-vocabulary suite's word list, training/words/english.txt.

The words are common English words that the default backbone's tokenizer holds as one whole-word
token (" word" is a single token) and that an English dictionary lists. The tokenizer gives words
the backbone meets often (the 24 words of the old suite are all among them); the dictionary drops
the sub-word pieces a BPE vocabulary also holds ("abbrev", "abnorm"). The list is committed, so
building the suite needs neither the tokenizer nor the dictionary package; this script is how it
was made:

    pip install --target /tmp/ew english-words==2.0.2
    PYTHONPATH=/tmp/ew .venv/bin/python -m scripts.word_list

training/vocab.py splits the list into training and held-out words by hash.
"""

from __future__ import annotations

import argparse
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "training" / "words" / "english.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--min-len", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=8)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from english_words import get_english_words_set  # a one-off dependency of this script only
    from transformers import AutoTokenizer

    from adapters_store.backbone.load import hf_dir

    tok = AutoTokenizer.from_pretrained(hf_dir(args.backbone))
    dictionary = get_english_words_set(["web2", "gcide"], lower=True, alpha=True)
    words = set()
    for piece in tok.get_vocab():
        word = tok.convert_tokens_to_string([piece])
        if word.startswith(" ") and word[1:].isascii() and word[1:].isalpha() and word[1:].islower():
            word = word[1:]
            if args.min_len <= len(word) <= args.max_len and word in dictionary:
                words.add(word)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(w + "\n" for w in sorted(words)))
    print(f"{len(words)} words -> {args.out}")


if __name__ == "__main__":
    main()
