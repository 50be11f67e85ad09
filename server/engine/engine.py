"""The engine: one thread running iteration-level continuous batching.

    loop:
        one background slice (if any, and if within its time share)   add_background_task(fn)
        drop cancelled waiting requests
        admit waiting requests (rows / tokens budgets) -> prefill them together -> first tokens
        merge them into the running batch (left-padding the KV caches)
        decode one token for every running row (one forward, rows of all tasks together)
        finished / cancelled rows leave the batch at once
        nothing to do -> sleep until a submit (or run background slices back to back)

The forward never runs on the asyncio loop; results reach it through RequestHandle.

Background time share: while requests are running or waiting, background slices (adaptation
steps, each far longer than a decode step) may take at most `background_share` of the engine's
time: after a slice of d seconds the engine serves for d * (1 - share) / share seconds before the
next one. With no traffic, slices run back to back.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from server.engine.batch import ModelRunner, Row, RunningBatch
from server.engine.detok import IncrementalDetokenizer
from server.engine.lora_plan import Planner
from server.engine.request import FinalEvent, FinishReason, GenRequest, TokenEvent
from server.engine.sampling import choose_tokens

log = logging.getLogger("polyserve.engine")


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"server overloaded: waiting queue is full; retry after {retry_after}s")
        self.retry_after = retry_after


class EngineStopped(Exception):
    pass


class Engine:
    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, routed_model: Any = None, *,
        max_batch_rows: int = 32, max_batch_tokens: int = 16384, max_prefill_rows: int = 16,
        max_queue: int = 256, skill_space_min_tasks: int = 0, compact_min_padding: float = 0.25,
        prefill_padding: float = 0.25, metrics: Any = None, background_share: float = 0.2,
    ) -> None:
        if not 0 < background_share <= 1:
            raise ValueError(f"background_share must be in (0, 1], got {background_share}")
        self.background_share = background_share
        self._serve_debt = 0.0  # seconds of serving owed before the next background slice
        self.tokenizer = tokenizer
        self.max_rows, self.max_tokens = max_batch_rows, max_batch_tokens
        self.max_prefill_rows, self.max_queue = max_prefill_rows, max_queue
        self.compact_min_padding = compact_min_padding
        self.prefill_padding = prefill_padding
        self.metrics = metrics
        self.planner = Planner(routed_model, skill_space_min_tasks)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.runner = ModelRunner(model, self.planner, int(pad or 0))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.batch = RunningBatch()
        self._waiting: deque[GenRequest] = deque()
        self._cond = threading.Condition()
        self._background: deque[Callable[[], bool]] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self._avg_request_s = 1.0

    # -- public API (any thread) -----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="polyserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, req: GenRequest) -> GenRequest:
        """Queue a request; raises QueueFull (-> 429) or ValueError (over the token budget)."""
        if req.budget_tokens > self.max_tokens:
            raise ValueError(f"prompt + max_new_tokens = {req.budget_tokens} exceeds max_batch_tokens "
                             f"{self.max_tokens}")
        if not req.prompt_ids:
            raise ValueError("prompt must hold at least one token")
        with self._cond:
            if self._stop:
                raise EngineStopped("engine is stopped")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(self.retry_after())
            self._waiting.append(req)
            self._gauges()
            self._cond.notify_all()
        return req

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained by one batch's worth."""
        batches = (len(self._waiting) + len(self.batch)) / max(1, self.max_rows)
        return max(1, math.ceil(batches * self._avg_request_s))

    def add_background_task(self, fn: Callable[[], bool]) -> None:
        """Interleave background work with decoding. `fn()` runs on the engine thread, does one
        short slice of work (say < 100 ms) and returns True while it has more to do. At most one
        slice runs between two decode steps (round-robin over tasks); with no requests in flight
        slices run back to back. The engine re-applies its adapter plan after each slice, so a
        slice may set its own plan on the routed model; it runs outside inference_mode."""
        with self._cond:
            self._background.append(fn)
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.batch)

    # -- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self.batch.rows and not self._background:
                    self._cond.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception:  # a bug: fail the rows in flight rather than hang their clients
                log.exception("engine step failed")
                self._fail_all("internal error in the engine step")
        self._fail_all("server shutting down", reason="cancelled")

    def step(self) -> None:
        """One iteration: a background slice, admissions + prefill, one decode step."""
        self._background_slice()
        started = time.perf_counter()
        with torch.inference_mode():
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
            if self.batch.rows:
                self._decode()
        self._serve_debt = max(0.0, self._serve_debt - (time.perf_counter() - started))
        self._gauges()

    def _has_traffic(self) -> bool:
        return bool(self.batch.rows or self._waiting)

    def _background_slice(self) -> None:
        traffic = self._has_traffic()
        if traffic and self._serve_debt > 0:
            return  # serve first: background work is over its time share
        with self._cond:
            fn = self._background.popleft() if self._background else None
        if fn is None:
            return
        started = time.perf_counter()
        try:
            more = bool(fn())
        except Exception:
            log.exception("background task failed; removed")
            more = False
        if traffic:
            share = self.background_share
            self._serve_debt = (time.perf_counter() - started) * (1 - share) / share
        # No planner reset needed: a slice that sets its own plan restores the engine's (or the
        # planner notices `batch.plan` is not its plan and sets it again before the next forward).
        if more:
            with self._cond:
                self._background.append(fn)

    def _admit(self) -> list[GenRequest]:
        tokens = sum(r.req.budget_tokens for r in self.batch.rows)
        out: list[GenRequest] = []
        with self._cond:
            while self._waiting:
                req = self._waiting[0]
                if req.handle.cancelled.is_set():
                    self._waiting.popleft()
                    req.handle.push(FinalEvent("", "cancelled", len(req.prompt_ids), 0))
                    continue
                if (len(self.batch) + len(out) >= self.max_rows or len(out) >= self.max_prefill_rows
                        or tokens + req.budget_tokens > self.max_tokens):
                    break
                self._waiting.popleft()
                tokens += req.budget_tokens
                out.append(req)
        return out

    def _new_row(self, req: GenRequest) -> Row:
        gen = None
        if not req.params.greedy:
            seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
            gen = torch.Generator().manual_seed(seed)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.stop)
        return Row(req, detok, gen, length=len(req.prompt_ids))

    def _prefill(self, reqs: list[GenRequest]) -> None:
        now = time.perf_counter()
        if self.metrics is not None:
            for r in reqs:
                self.metrics.queue_wait.observe(now - r.arrival)
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))
        for group in prefill_groups(reqs, self.prefill_padding):
            self._prefill_group(group)

    def _prefill_group(self, reqs: list[GenRequest]) -> None:
        rows = [self._new_row(r) for r in reqs]
        cache, mask, logits = self.runner.prefill(rows)
        keep = self._advance(rows, logits)
        if keep:
            new = RunningBatch()
            new.extend(rows, cache, mask)
            new.filter(keep, self.compact_min_padding)
            self.batch.extend(new.rows, new.cache, new.mask)  # type: ignore[arg-type]

    def _decode(self) -> None:
        # cancelled rows leave before the forward: a disconnect frees its row within one step
        live = [i for i, r in enumerate(self.batch.rows) if not r.req.handle.cancelled.is_set()]
        if len(live) < len(self.batch.rows):
            for r in self.batch.rows:
                if r.req.handle.cancelled.is_set():
                    self._finish(r, "cancelled")
            self.batch.filter(live, self.compact_min_padding)
            if not self.batch.rows:
                return
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(self.batch.rows))
        logits = self.runner.decode(self.batch)
        self.steps += 1
        keep = self._advance(self.batch.rows, logits)
        self.batch.filter(keep, self.compact_min_padding)

    def _advance(self, rows: list[Row], logits: torch.Tensor) -> list[int]:
        """Sample one token per row, emit text, finish rows; returns indices of rows that go on."""
        tokens = choose_tokens(
            logits, [r.req.params.greedy for r in rows], [r.req.params.temperature for r in rows],
            [r.req.params.top_k for r in rows], [r.req.params.top_p for r in rows], [r.generator for r in rows],
        )
        now = time.perf_counter()
        keep = []
        m = self.metrics
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            params = row.req.params
            row.generated += 1
            if m is not None:
                m.generation_tokens.inc()
                if row.generated == 1:
                    m.ttft.observe(now - row.req.arrival)
                else:
                    m.inter_token.observe(now - row.last_token_at)
            row.last_token_at = now
            row.last_token = token
            if token in self.eos_ids and not params.ignore_eos:
                self._finish(row, "stop")
                continue
            text = row.detok.add(token)
            if row.detok.stopped:
                self._finish(row, "stop", text)
            elif row.generated >= params.max_new_tokens or (
                self.max_positions is not None and row.length + 1 >= self.max_positions
            ):
                self._finish(row, "length", text)
            else:
                if text or row.generated == 1:
                    row.req.handle.push(TokenEvent(text, token))
                keep.append(i)
        return keep

    def _finish(self, row: Row, reason: FinishReason, text: str = "") -> None:
        row.finish = reason
        text += row.detok.flush() if reason != "cancelled" else ""
        row.req.handle.push(FinalEvent(text, reason, len(row.req.prompt_ids), row.generated))
        elapsed = time.perf_counter() - row.req.arrival
        self._avg_request_s = 0.9 * self._avg_request_s + 0.1 * elapsed

    def _fail_all(self, message: str, reason: FinishReason = "cancelled") -> None:
        for row in self.batch.rows:
            row.req.handle.push(FinalEvent("", reason, len(row.req.prompt_ids), row.generated, error=message))
        self.batch = RunningBatch()
        self.planner.invalidate()
        with self._cond:
            while self._waiting:
                req = self._waiting.popleft()
                req.handle.push(FinalEvent("", reason, len(req.prompt_ids), 0, error=message))

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(len(self.batch))
            self.metrics.waiting.set(len(self._waiting))


def prefill_groups(reqs: list[GenRequest], slack: float) -> list[list[GenRequest]]:
    """Split admitted requests into prefill forwards of similar prompt length: sorted by length,
    a group grows while its padded size stays within (1 + slack) x its real tokens. (Left-padding
    a 10-token prompt to 80 would cost 8x its compute; separate forwards cost one launch each.)"""
    out: list[list[GenRequest]] = []
    group: list[GenRequest] = []
    real = 0
    for req in sorted(reqs, key=lambda r: len(r.prompt_ids)):
        n = len(req.prompt_ids)
        if group and n * (len(group) + 1) > (1 + slack) * (real + n):
            out.append(group)
            group, real = [], 0
        group.append(req)
        real += n
    if group:
        out.append(group)
    return out


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return frozenset(ids)
