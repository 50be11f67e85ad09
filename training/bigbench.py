"""A real-task suite from BIG-bench's JSON tasks, read offline from the ``bigbench==1.0.0`` sdist.

The data only: the sdist's ``bigbench/benchmark_tasks/**/task.json`` files are read straight out of
the archive (the package is never installed, nor its dependencies) and turned into the suite's
rows, cached under ``$POLYSERVE_HOME/bigbench/``:

    {"task": "bb-word_sorting", "input": "stick gelatine", "output": "gelatine stick",
     "split": "train", "targets": [...], "choices": [...]}

- Generative tasks (``target``): ``output`` is the first target; ``targets`` all of them (a greedy
  answer matching any one counts).
- Multiple-choice tasks (``target_scores``): the choices are appended to the input as BIG-Bench Hard
  does ("Options:" and one per line), ``output`` is the best-scored choice, and ``choices`` keeps them
  all, so a task is scored by exact match of the chosen answer and by log-likelihood ranking. The
  options are listed in an order drawn from a hash of the example, not the task file's: several
  task files list the right answer first nearly always (date_understanding, temporal_sequences;
  docs/RESULTS.md), which a model learns from 16 examples without reading the question.
- Each example's split (train 80% / valid 10% / test 10%) is a hash of its task and text (the options
  in the task file's order), so it never moves between runs, nor with the displayed order.
- Held out for evaluation (never trained on, whole source tasks with every subtask): every BIG-Bench
  Hard source task in the archive, :data:`BBH_SOURCES`. The rest are training tasks when enough of
  their examples fit the backbone's context (:data:`TRAIN_MAX_CHARS`).

``scripts/bigbench_suite.py`` fetches the archive and builds the cache; ``polyserve train --suite
bigbench`` trains on the cached training tasks.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from adapters_store.backbone.home import polyserve_home
from training.data import Example
from training.real_tasks import PAIRS as REAL_PAIRS

ARCHIVE_NAME = "bigbench-1.0.0.tar.gz"
#: The sdist's sha256 as the package index lists it: a fetched or given archive must match it.
ARCHIVE_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
INDEX_URL = "https://pypi.org/simple/bigbench/"
#: Bump when the conversion changes: the cache of another version is rebuilt.
FORMAT_VERSION = 2

#: The BIG-bench source tasks of BIG-Bench Hard (the set published few-shot reuse results, LoraHub's
#: among them, are measured on). Held out whole, with their subtasks.
BBH_SOURCES = (
    "boolean_expressions", "causal_judgment", "date_understanding", "disambiguation_qa", "dyck_languages",
    "formal_fallacies_syllogisms_negation", "geometric_shapes", "hyperbaton", "logical_deduction",
    "movie_recommendation", "multistep_arithmetic", "navigate", "object_counting", "penguins_in_a_table",
    "reasoning_about_colored_objects", "ruin_names", "salient_translation_error_detection", "snarks",
    "sports_understanding", "temporal_sequences", "tracking_shuffled_objects", "web_of_lies",
    "word_sorting",
)
#: A training task's example must fit the training context (prompts of about 128 tokens): input and
#: output together at most this many characters; a task needs MIN_TRAIN_EXAMPLES such examples.
TRAIN_MAX_CHARS = 400
MIN_TRAIN_EXAMPLES = 32
#: Examples kept per task (the largest tasks hold tens of thousands).
MAX_EXAMPLES_PER_TASK = 1000
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class BBTask:
    """One converted task (a source task, or one subtask of it)."""

    id: str            # "bb-<source>" or "bb-<source>.<subtask>"
    source: str        # the BIG-bench task directory
    kind: str          # "generative" | "multiple_choice"
    heldout: bool
    rows: tuple[dict[str, Any], ...]

    def examples(self, split: str) -> list[Example]:
        return [Example(self.id, r["input"], r["output"]) for r in self.rows if r["split"] == split]

    def split_rows(self, split: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["split"] == split]


def cache_dir() -> Path:
    return polyserve_home() / "bigbench"


def _hash(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:8], "big")


def split_of(task_id: str, text: str) -> str:
    bucket = _hash("bb-split", task_id, text) % 10
    return "test" if bucket == 0 else ("valid" if bucket == 1 else "train")


def task_id(source: str, subtask: str | None) -> str:
    tid = f"bb-{source}" + (f".{subtask}" if subtask else "")
    return tid.lower()[:64]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def with_options(question: str, choices: list[str]) -> str:
    """BIG-Bench Hard's way: the options under the question, one a line."""
    return question.rstrip() + "\nOptions:\n" + "\n".join(f"- {c}" for c in choices)


def option_order(tid: str, question: str, choices: list[str]) -> list[str]:
    """The order the options are shown in: a hash of the example and each choice, so the right
    answer's place says nothing (the task files often list it first) and never moves between runs."""
    return sorted(choices, key=lambda c: _hash("bb-options", tid, question, c))


def convert_example(tid: str, ex: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """One task.json example -> (a suite row, the example's key), or None when it has no usable
    answer. The key (the question with its options in the task file's order) is what the split
    and the sampling hash."""
    question = _text(ex.get("input")).strip()
    if not question:
        return None
    scores = ex.get("target_scores")
    if isinstance(scores, dict) and scores:
        choices = [str(c) for c in scores]
        best = max(choices, key=lambda c: float(scores[c]))
        key = with_options(question, choices)
        shown = option_order(tid, question, choices)
        return ({"task": tid, "input": with_options(question, shown), "output": best, "choices": shown,
                 "split": split_of(tid, key)}, key)
    target = ex.get("target")
    targets = [target] if isinstance(target, str) else [t for t in (target or []) if isinstance(t, str)]
    targets = [t.strip() for t in targets if t.strip()]
    if not targets:
        return None
    return {"task": tid, "input": question, "output": targets[0], "targets": targets,
            "split": split_of(tid, question)}, question


def _task_jsons(archive: Path) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """(source, subtask or None, parsed task.json) for every JSON task in the sdist, streamed."""
    with tarfile.open(archive, "r:gz") as tf:
        for member in tf:
            parts = PurePosixPath(member.name).parts
            if not member.isfile() or parts[-1] != "task.json" or "benchmark_tasks" not in parts:
                continue
            rel = parts[parts.index("benchmark_tasks") + 1 : -1]
            if len(rel) not in (1, 2):
                continue
            f = tf.extractfile(member)
            if f is None:
                continue
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(data, dict) and isinstance(data.get("examples"), list) and data["examples"]:
                yield rel[0], (rel[1] if len(rel) == 2 else None), data


def convert(archive: Path) -> list[BBTask]:
    """Every JSON task of the archive as a BBTask (held-out ones whole; training ones that fit)."""
    out = []
    for source, subtask, data in _task_jsons(archive):
        tid = task_id(source, subtask)
        keyed = [c for ex in data["examples"] if isinstance(ex, dict) and (c := convert_example(tid, ex))]
        seen: set[str] = set()
        keyed = [(r, k) for r, k in keyed if not (k in seen or seen.add(k))]  # type: ignore[func-returns-value]
        heldout = source in BBH_SOURCES
        if not heldout:
            keyed = [(r, k) for r, k in keyed if len(r["input"]) + len(r["output"]) <= TRAIN_MAX_CHARS]
            if len(keyed) < MIN_TRAIN_EXAMPLES:
                continue
        if not keyed:
            continue
        keyed.sort(key=lambda rk: _hash("bb-order", tid, rk[1]))  # a fixed sample of the largest tasks
        rows = [r for r, _ in keyed[:MAX_EXAMPLES_PER_TASK]]
        kind = "multiple_choice" if "choices" in rows[0] else "generative"
        out.append(BBTask(tid, source, kind, heldout, tuple(rows)))
    return sorted(out, key=lambda t: t.id)


def build_cache(archive: Path, out: Path | None = None) -> Path:
    """Convert the archive into `out` (default: the cache dir): tasks.json (index) and one JSONL of all
    rows. Written to a temporary name and renamed, so a crash leaves no half cache."""
    digest = sha256_file(archive)
    if digest != ARCHIVE_SHA256:
        raise ValueError(f"{archive} is not the bigbench 1.0.0 sdist (sha256 {digest[:16]}..., expected "
                         f"{ARCHIVE_SHA256[:16]}...)")
    return write_cache(convert(archive), out or cache_dir(), digest)


def write_cache(tasks: list[BBTask], out: Path, digest: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rows_tmp, index_tmp = out / "rows.jsonl.tmp", out / "tasks.json.tmp"
    with rows_tmp.open("w") as f:
        for t in tasks:
            for r in t.rows:
                f.write(json.dumps(r) + "\n")
    index = {"format": FORMAT_VERSION, "archive_sha256": digest,
             "tasks": [{"id": t.id, "source": t.source, "kind": t.kind, "heldout": t.heldout,
                        **{s: len(t.split_rows(s)) for s in SPLITS}} for t in tasks]}
    index_tmp.write_text(json.dumps(index, indent=1) + "\n")
    rows_tmp.replace(out / "rows.jsonl")
    index_tmp.replace(out / "tasks.json")  # last: its presence marks a complete cache
    return out


def load_cache(where: Path | None = None) -> list[BBTask]:
    """The cached suite; FileNotFoundError naming the command that builds it when there is none."""
    where = where or cache_dir()
    index_path = where / "tasks.json"
    if not index_path.exists():
        raise FileNotFoundError(f"no BIG-bench suite in {where}: build it with `python -m scripts.bigbench_suite`")
    index = json.loads(index_path.read_text())
    if index.get("format") != FORMAT_VERSION:
        raise FileNotFoundError(f"the BIG-bench suite in {where} is of another format: rebuild it with "
                                "`python -m scripts.bigbench_suite`")
    rows: dict[str, list[dict[str, Any]]] = {}
    with (where / "rows.jsonl").open() as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["task"], []).append(r)
    return [BBTask(t["id"], t["source"], t["kind"], t["heldout"], tuple(rows.get(t["id"], ())))
            for t in index["tasks"]]


def training_suite(examples_per_task: int, where: Path | None = None,
                   one_per_source: bool = False) -> dict[str, list[Example]]:
    """The training tasks' split-"train" examples (what `polyserve train --suite bigbench` trains on),
    less any whose input is a real task's (`decontaminated`); one_per_source: only each source's largest
    task (`one_task_per_source`)."""
    tasks = [t for t in load_cache(where) if not t.heldout]
    if one_per_source:
        tasks = one_task_per_source(tasks)
    return {t.id: decontaminated(t.examples("train"))[:examples_per_task] for t in tasks}


def _key(text: str) -> str:
    return " ".join(text.lower().split())


#: The inputs of the hand-written real tasks (training.real_tasks), compared case- and space-blind.
REAL_INPUTS = frozenset(_key(x) for pairs in REAL_PAIRS.values() for x, _ in pairs)


def decontaminated(examples: list[Example]) -> list[Example]:
    """`examples` less those whose input is a real task's: BIG-bench's linguistic_mappings asks the
    past tense of the same common verbs, and an inventory trained on them would be scored on its
    training pairs."""
    return [e for e in examples if _key(e.input) not in REAL_INPUTS]


def one_task_per_source(tasks: list[BBTask]) -> list[BBTask]:
    """Each source's task with the most split-"train" rows (ties: the first id), in id order.

    Some sources ship one task in many variants (multiemo: one subtask per language and domain);
    with uniform task sampling they take batches in proportion to their number and each variant's
    routing row sees few examples. One task a source spreads the same steps over distinct tasks."""
    size = {t.id: len(t.split_rows("train")) for t in tasks}
    best: dict[str, BBTask] = {}
    for t in sorted(tasks, key=lambda t: (-size[t.id], t.id)):
        best.setdefault(t.source, t)
    return sorted(best.values(), key=lambda t: t.id)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_archive(dest_dir: Path | None = None, index_url: str = INDEX_URL) -> Path:
    """Download the sdist from the package index into `dest_dir` (default: the cache dir), checking its
    sha256. `pip download --no-deps bigbench==1.0.0` cannot do it: pip builds the sdist's metadata,
    which declares a direct-URL dependency the index refuses. So this reads the index's page for the
    project (PEP 503) and takes the file it links."""
    import re
    import urllib.request

    dest_dir = dest_dir or cache_dir()
    dest = dest_dir / ARCHIVE_NAME
    if dest.exists() and sha256_file(dest) == ARCHIVE_SHA256:
        return dest
    with urllib.request.urlopen(index_url, timeout=60) as resp:
        page = resp.read().decode()
    links = re.findall(r'href="([^"]*' + re.escape(ARCHIVE_NAME) + r'[^"]*)"', page)
    if not links:
        raise FileNotFoundError(f"{index_url} lists no {ARCHIVE_NAME}")
    url = links[0].split("#")[0]
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as resp, tmp.open("wb") as f:
        while block := resp.read(1 << 20):
            f.write(block)
    if sha256_file(tmp) != ARCHIVE_SHA256:
        tmp.unlink()
        raise ValueError(f"the file at {url} does not have the sha256 the suite expects")
    tmp.replace(dest)
    return dest
