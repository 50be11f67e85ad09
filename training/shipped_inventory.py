"""The default inventory shipped as read-only package data, and its copy into a working store.

    training/default_inventory/inventory/inventory.json, skills.safetensors
    training/default_inventory/tasks/<id>/task.json, routing-<v>-<digest>.safetensors

(the store layout, with the training tasks' routing rows). `install_default_inventory(store)`
copies it into a working store (any backend) that has no inventory; nothing is ever written into the
package directory at run time. A shipped task's record carries the suite's description of it and a
few examples (`describe`; `describe_shipped(store)` adds them to a store installed without).
`python -m training.shipped_inventory --from-store DIR` refreshes
the package data from a freshly trained store (a development step, see
scripts/train_default_inventory.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

from adapters_store.store.atomic import read_json
from adapters_store.store.contract import AdapterStore
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import TaskNotFound
from adapters_store.store.ids import validate_task_id
from adapters_store.store.records import MAX_RECORD_EXAMPLES, InventoryInfo, TaskRecord

PACKAGE_DIR = Path(__file__).resolve().parent / "default_inventory"
WORDS_DIR = Path(__file__).resolve().parent / "words"
# What the wheel's package data may weigh, inventory and word lists together: a server installs it
# on every node, and pip downloads it with every upgrade.
PACKAGE_BUDGET_BYTES = 40 * 1000 * 1000


def tree_bytes(*roots: Path) -> int:
    """Bytes of the files under each existing root."""
    return sum(p.stat().st_size for root in roots if root.exists() for p in root.rglob("*") if p.is_file())


def default_inventory_available(source: Path | None = None) -> bool:
    src = Path(source) if source is not None else PACKAGE_DIR
    return (src / "inventory" / "inventory.json").is_file() and (src / "inventory" / "skills.safetensors").is_file()


def _task_dirs(src: Path) -> list[Path]:
    return sorted(p.parent for p in (src / "tasks").glob("*/task.json"))


def install_default_inventory(store: AdapterStore, source: Path | None = None) -> bool:
    """Copy the shipped inventory and its tasks' routing rows into `store` if it has no inventory.

    Returns True if it copied, False if the store already had an inventory (left untouched)
    or no default inventory is shipped. Tasks the store already has are never overwritten.
    Processes starting together install it once (`AdapterStore.install_once`); every task and the
    inventory are checked against their digests on the way in; the inventory goes last.
    """
    src = Path(source) if source is not None else PACKAGE_DIR
    if not default_inventory_available(src):
        return False
    return store.install_once(lambda target: _install(target, src))


def suite_description(task: str) -> str | None:
    """What a suite task does, from its primitives' definitions (training/suite.py); None for an
    id that is no composition of them.

    >>> suite_description("rev-words.upper")
    'Reverse the order of the tokens; then uppercase every letter.'
    """
    from training.suite import PRIMITIVES, parse_task

    try:
        spec = parse_task(task)
    except ValueError:
        return None
    parts = [(PRIMITIVES[p].__doc__ or p).split(". ")[0].replace("``", '"').removesuffix(" (terminal)")
             for p in spec.primitives]
    return parts[0] + "".join(f"; then {q[:1].lower()}{q[1:]}" for q in parts[1:]) + "."


def describe(record: TaskRecord) -> TaskRecord:
    """`record` with the suite's description and examples where it has none (a shipped task)."""
    if record.description is not None:
        return record
    text = suite_description(record.id)
    if text is None:
        return record
    from training.suite import examples, parse_task

    shown = [{"input": e.input, "output": e.output} for e in examples(parse_task(record.id), MAX_RECORD_EXAMPLES, 0)]
    return replace(record, description=text, examples=record.examples or shown)


def describe_shipped(store: AdapterStore) -> int:
    """Add the suite's description and examples to the shipped tasks of `store` that have none
    (a store installed before records carried them); returns how many it wrote."""
    written = 0
    for record in store.list_tasks():
        if record.description is not None or record.owner is not None or record.source.get("kind") != "pretraining":
            continue
        if suite_description(record.id) is None:
            continue
        with store.task_lock(record.id):
            try:
                current = store.get_task(record.id)
            except TaskNotFound:
                continue
            if current.description is None and current.digest == record.digest:
                store.put_record(describe(current))
                written += 1
    return written


def _install(store: AdapterStore, src: Path) -> bool:
    for task_dir in _task_dirs(src):
        task = validate_task_id(task_dir.name)
        if store.has_task(task):
            continue
        data = read_json(task_dir / "task.json")
        if data.get("id") != task or not data.get("file"):
            raise ValueError(f"{task_dir}/task.json does not describe task {task!r}")
        record = describe(TaskRecord.from_json(data))
        store.import_task(record, (task_dir / Path(str(record.file)).name).read_bytes())
    # The inventory last: a crash before this leaves a store that installs again on next start.
    info = InventoryInfo.from_json(read_json(src / "inventory" / "inventory.json"))
    store.import_inventory(info, (src / "inventory" / "skills.safetensors").read_bytes())
    return True


def export_store(store_root: Path, dest: Path = PACKAGE_DIR, budget: int = PACKAGE_BUDGET_BYTES) -> dict[str, object]:
    """Replace `dest` with the inventory of `store_root` and its pre-training tasks' routing rows.
    Refused, with `dest` left as it was, where the new package data (with the word lists) would
    weigh more than `budget` bytes."""
    store = DirectoryStore(store_root)
    info = store.inventory_info()
    tasks = [r for r in store.list_tasks() if r.kind == "routing" and r.source.get("kind") == "pretraining"]
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "inventory").mkdir(parents=True)
    for name in ("inventory.json", "skills.safetensors"):
        shutil.copy2(store.root / "inventory" / name, tmp / "inventory" / name)
    for record in tasks:
        (tmp / "tasks" / record.id).mkdir(parents=True)
        shutil.copy2(store.root / "tasks" / record.id / str(record.file), tmp / "tasks" / record.id / str(record.file))
        shutil.copy2(store.root / "tasks" / record.id / "task.json", tmp / "tasks" / record.id / "task.json")
    size = tree_bytes(tmp, WORDS_DIR)
    if size > budget:
        shutil.rmtree(tmp)
        raise ValueError(f"the package data would weigh {size:,} bytes "
                         f"(inventory {tree_bytes(store.root / 'inventory'):,}, "
                         f"{len(tasks)} tasks' rows, word lists), over its budget of {budget:,}: ship fewer or smaller "
                         f"skills, or fewer tasks' rows; {dest} is unchanged")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return {"dest": str(dest), "inventory_version": info.version, "tasks": len(tasks), "package_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-store", required=True, type=Path, help="a trained store to ship")
    parser.add_argument("--dest", type=Path, default=PACKAGE_DIR)
    args = parser.parse_args()
    try:
        print(json.dumps(export_store(args.from_store, args.dest)))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
