"""The default inventory shipped as read-only package data, and its copy into a working store.

    training/default_inventory/inventory/inventory.json, skills.safetensors
    training/default_inventory/tasks/<id>/task.json, routing-<v>-<digest>.safetensors

(the store layout, with the training tasks' routing rows). `install_default_inventory(store)`
copies it into a working store (any backend) that has no inventory; nothing is ever written into the
package directory at run time. A shipped task's record carries the suite's description of it and a
few examples (`describe`), and its measured quality (`quality`: exact match on held-out words and,
for a word-level task, on sentences; written by scripts/shipped_quality.py). A task whose held-out
figure is below QUALITY_FLOOR is left out unless the opt-in (POLYSERVE_SHIPPED_BELOW_FLOOR) asks for
it, and is then marked `below_floor`. `refresh_shipped(store)` brings a store installed before
records carried these up to date (and installs the tasks below the floor there, when opted in).
`python -m training.shipped_inventory --from-store DIR` refreshes
the package data from a freshly trained store (a development step, see
scripts/train_default_inventory.sh).
"""

from __future__ import annotations

import argparse
import json
import os
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
# A shipped task that gets fewer than half of its held-out inputs right is not installed by default:
# a user who tries it on words of their own gets more wrong answers than right ones (`caesar`,
# `rev-chars`: none right). The opt-in installs them too, marked `below_floor` (docs/RESULTS.md).
QUALITY_FLOOR = 0.5
# the opt-in, a POLYSERVE_* setting (server/wiring/settings.py reads it for the server and workers;
# the offline commands read it here)
OPT_IN_ENV = "POLYSERVE_SHIPPED_BELOW_FLOOR"


def tree_bytes(*roots: Path) -> int:
    """Bytes of the files under each existing root."""
    return sum(p.stat().st_size for root in roots if root.exists() for p in root.rglob("*") if p.is_file())


def default_inventory_available(source: Path | None = None) -> bool:
    src = Path(source) if source is not None else PACKAGE_DIR
    return (src / "inventory" / "inventory.json").is_file() and (src / "inventory" / "skills.safetensors").is_file()


def _task_dirs(src: Path) -> list[Path]:
    return sorted(p.parent for p in (src / "tasks").glob("*/task.json"))


def opted_in() -> bool:
    """Whether the environment asks for the shipped tasks below the floor too (OPT_IN_ENV), read
    as the settings read a boolean (true/false, on/off, yes/no, 1/0), so both agree on every value;
    ValueError naming the variable for any other."""
    from pydantic import TypeAdapter, ValidationError

    raw = os.environ.get(OPT_IN_ENV)
    if raw is None or not raw.strip():
        return False
    try:
        return TypeAdapter(bool).validate_python(raw.strip())
    except ValidationError:
        raise ValueError(f"{OPT_IN_ENV} must be a boolean (true/false, 1/0), got {raw!r}") from None


def below_floor(record: TaskRecord) -> bool:
    """Whether a shipped task was measured below QUALITY_FLOOR on held-out words (never measured: no)."""
    return bool(record.quality) and float(record.quality["heldout_exact"]) < QUALITY_FLOOR


def as_installed(record: TaskRecord, below_floor_too: bool) -> TaskRecord | None:
    """A shipped record as a store gets it: described, and marked `below_floor` where it is under
    the floor; None for such a task unless `below_floor_too` (the opt-in)."""
    record = describe(record)
    if not below_floor(record):
        return record
    if not below_floor_too:
        return None
    return replace(record, quality={**record.quality, "below_floor": True})


def install_default_inventory(store: AdapterStore, source: Path | None = None,
                              below_floor_too: bool | None = None) -> bool:
    """Copy the shipped inventory and its tasks' routing rows into `store` if it has no inventory.

    Returns True if it copied, False if the store already had an inventory (left untouched)
    or no default inventory is shipped. Tasks the store already has are never overwritten; tasks
    below QUALITY_FLOOR are left out unless `below_floor_too` (default: the opt-in, OPT_IN_ENV).
    Processes starting together install it once (`AdapterStore.install_once`); every task and the
    inventory are checked against their digests on the way in; the inventory goes last.
    """
    src = Path(source) if source is not None else PACKAGE_DIR
    if not default_inventory_available(src):
        return False
    opt_in = opted_in() if below_floor_too is None else below_floor_too
    return store.install_once(lambda target: _install(target, src, opt_in))


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


def shipped_records(source: Path | None = None) -> dict[str, TaskRecord]:
    """The shipped tasks' records as packaged, by id."""
    src = Path(source) if source is not None else PACKAGE_DIR
    out = {}
    for task_dir in _task_dirs(src):
        task = validate_task_id(task_dir.name)
        data = read_json(task_dir / "task.json")
        if data.get("id") != task or not data.get("file"):
            raise ValueError(f"{task_dir}/task.json does not describe task {task!r}")
        out[task] = TaskRecord.from_json(data)
    return out


def _completed(record: TaskRecord, wanted: TaskRecord) -> TaskRecord:
    """`record` with what it lacks of `wanted`'s description, examples and quality."""
    return replace(record, description=record.description or wanted.description,
                   examples=record.examples or wanted.examples, quality=record.quality or wanted.quality)


def refresh_shipped(store: AdapterStore, source: Path | None = None, below_floor_too: bool | None = None) -> int:
    """Bring the shipped tasks of a store installed before records carried a description and a
    measured quality up to date: each unchanged shipped task (same weights, no owner) that lacks
    them gets the package's (and the `below_floor` mark where it is under the floor; it stays
    installed). With the opt-in (`below_floor_too`, default OPT_IN_ENV), the shipped tasks below
    the floor that the store lacks are installed, when its inventory is the shipped one.
    Returns how many records it wrote."""
    src = Path(source) if source is not None else PACKAGE_DIR
    shipped = shipped_records(src) if default_inventory_available(src) else {}
    written = 0
    for record in store.list_tasks():
        if record.owner is not None or record.source.get("kind") != "pretraining":
            continue
        package = shipped.get(record.id)
        wanted = as_installed(package, True) if package is not None and package.digest == record.digest \
            else describe(record)
        if wanted is None or _completed(record, wanted) == record:
            continue
        with store.task_lock(record.id):
            try:
                current = store.get_task(record.id)
            except TaskNotFound:
                continue
            if (current.digest, current.version) == (record.digest, record.version):
                store.put_record(_completed(current, wanted))
                written += 1
    opt_in = opted_in() if below_floor_too is None else below_floor_too
    if opt_in and shipped and store.has_inventory():
        info = InventoryInfo.from_json(read_json(src / "inventory" / "inventory.json"))
        if store.inventory_info().version == info.version:
            for task, package in shipped.items():
                installed = as_installed(package, True)
                if installed is None or not below_floor(package) or store.has_task(task):
                    continue
                with store.task_lock(task):
                    if not store.has_task(task):
                        store.import_task(installed, (src / "tasks" / task / str(package.file)).read_bytes())
                        written += 1
    return written


def _install(store: AdapterStore, src: Path, below_floor_too: bool) -> bool:
    for task, package in shipped_records(src).items():
        record = as_installed(package, below_floor_too)
        if record is None or store.has_task(task):
            continue
        store.import_task(record, (src / "tasks" / task / Path(str(record.file)).name).read_bytes())
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
