"""Errors raised by the store; the server maps them to HTTP statuses in one place."""


class StoreError(Exception):
    """Something about the store's content is wrong or missing."""


class TaskNotFound(StoreError, KeyError):
    def __init__(self, task: str) -> None:
        super().__init__(f"task {task!r} not found")
        self.task = task

    def __str__(self) -> str:  # KeyError would print the repr
        return str(self.args[0])


class JobNotFound(StoreError, KeyError):
    def __init__(self, job: str) -> None:
        super().__init__(f"job {job!r} not found")
        self.job = job

    def __str__(self) -> str:
        return str(self.args[0])


class TaskExists(StoreError):
    pass


class TaskLimit(StoreError):
    """The store holds as many tasks as it may (POLYSERVE_MAX_TASKS)."""


class FingerprintMismatch(StoreError):
    pass


class StoreUnavailable(StoreError):
    """The store cannot be reached right now (a database down or restarting): retry later."""
