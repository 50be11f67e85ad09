"""A job's error, as a client reads it (GET /v1/jobs/{id}, the task's `error`), carries no
filesystem path: store paths reveal the deployment's layout (the server log keeps the full text)."""

from __future__ import annotations

import pytest

from server.jobs.public_errors import scrub
from tests.server.jobs.test_jobs_runner import EXAMPLES, make_runner, run_to_end, store  # noqa: F401 - fixture


@pytest.mark.parametrize("message,public", [
    ("[Errno 2] No such file or directory: '/srv/polyserve/store/tasks/t/task.json'",
     "[Errno 2] No such file or directory: '<path>'"),
    ("cannot write store/tasks/t/routing-2.safetensors: disk full", "cannot write <path>: disk full"),
    ("~/.cache/polyserve/store is read-only", "<path> is read-only"),
    ("loss is NaN at step 3", "loss is NaN at step 3"),
])
def test_scrub(message, public):
    assert scrub(message) == public


def test_a_failed_job_shows_no_path(store, monkeypatch):  # noqa: F811
    runner, _ = make_runner(store)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0)
    secret_dir = str(store.root.resolve())

    def fail(*_a, **_k):
        raise OSError(f"[Errno 28] No space left on device: '{secret_dir}/tasks/t/routing-1.safetensors'")

    monkeypatch.setattr(store, "put_routing", fail)
    run_to_end(runner)
    failed = runner.get(job.id)
    assert failed.status == "failed" and failed.error["type"] == "store_error"
    assert "No space left on device" in failed.error["message"]
    assert secret_dir not in failed.error["message"] and "/" not in failed.error["message"]
    assert secret_dir not in (store.get_task("t").error or "")
