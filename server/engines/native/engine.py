"""The engine: one thread running iteration-level continuous batching.

    loop:
        one background slice (if any, and if within its time share)   add_background_task(fn)
        drop cancelled waiting requests
        admit waiting requests (rows / tokens budgets) -> prefill them together -> first tokens
        (a request with n choices is prefilled once, then its KV row is forked n times)
        merge them into the running batch (left-padding the KV caches)
        decode one token for every running row (one forward, rows of all tasks together)
        finished / cancelled rows leave the batch at once
        nothing to do -> sleep until a submit (or run background slices back to back)

The forward never runs on the asyncio loop; results reach it through RequestHandle.

Fault isolation (one bad request fails only itself; every admitted choice gets exactly one
FinalEvent, see ledger.py):
    a row's sampling / detokenisation / stop check / events raise -> that row fails (error final)
    a prefill forward raises  -> its group is split in halves and retried; a request that fails
                                 alone fails
    a decode forward raises   -> KV rolled back; bisection finds the rows that fail alone
                                 (isolate.py); they fail, the others decode again (once)
    anything else in a step   -> last resort: the rows in flight fail, the waiting queue is kept
    the engine thread dies / stops -> everything still owed an answer fails, submit -> EngineStopped

Background time share: while requests are running or waiting, background slices (adaptation
steps, each far longer than a decode step) may take at most `background_share` of the engine's
time: after a slice of d seconds the engine serves for d * (1 - share) / share seconds before the
next one. With no traffic, slices run back to back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from server.engines.base import EngineStopped, QueueFull, check_fits
from server.engines.native import kv
from server.engines.native.batch import ModelRunner, Row, RunningBatch, prefill_groups
from server.engines.native.isolate import find_culprits
from server.engines.native.ledger import FinalLedger, answer_unadmitted
from server.engines.native.logprobs import prompt_logprobs
from server.engines.native.lora_plan import Planner
from server.engines.native.packed import pack_linears, packed_count
from server.engines.native.rows import describe, new_rows, sample_rows, vocab_size
from server.engines.request import FinalEvent, FinishReason, GenRequest, TokenEvent, TokenLogprob

log = logging.getLogger("polyserve.engine")

class NativeEngine:
    """The embedded engine (server.engines.base.Engine)."""

    name = "native"

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, routed_model: Any = None, *,
        max_batch_rows: int = 32, max_batch_tokens: int = 16384, max_prefill_rows: int = 16,
        max_queue: int = 256, skill_space_min_tasks: int = 0, compact_min_padding: float = 0.25,
        prefill_padding: float = 0.25, metrics: Any = None, background_share: float = 0.2,
        packed_weights: bool = False,
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
        if packed_weights:  # before the runner: it only reads the model's device
            extra = pack_linears(model)
            log.info("native engine: %d backbone linears packed for oneDNN (+%.0f MiB)",
                     packed_count(model), extra / 2**20)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.runner = ModelRunner(model, self.planner, int(pad or 0))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.vocab_size = vocab_size(model)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.batch = RunningBatch()
        self.ledger = FinalLedger()  # choices admitted and not yet answered
        self._waiting: deque[GenRequest] = deque()
        self._cond = threading.Condition()
        self._background: deque[Callable[[], bool]] = deque()
        self._stop = False
        self._dead = False
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
            if not self._thread.is_alive():
                self._thread = None
        elif not self._dead:  # never started: answer what was queued
            self._shutdown("server shutting down")

    def submit(self, req: GenRequest) -> GenRequest:
        """Queue a request; raises QueueFull (-> 429), EngineStopped (-> 503) or ValueError (it
        can never run here: over a budget, n over max_batch_rows, a logit_bias token outside
        the vocabulary)."""
        check_fits(req, max_tokens=self.max_tokens, max_rows=self.max_rows, vocab_size=self.vocab_size)
        with self._cond:
            if self._stop or self._dead:
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

    def forget(self, task: str) -> None:
        """Nothing to drop: rows in flight hold their Adapter objects; the planner keys plans by them."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.batch)

    # -- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        reason = "server shutting down"
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._waiting and not self.batch.rows and not self._background:
                        self._cond.wait()
                    if self._stop:
                        break
                try:
                    self.step()
                except Exception:  # a bug outside the isolated parts: fail the rows in flight only
                    log.exception("engine step failed")
                    self._fail_all("internal error in the engine step")
        except BaseException:
            log.exception("engine thread died")
            reason = "engine stopped unexpectedly"
            raise
        finally:
            self._shutdown(reason)

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
        """Pop what fits; budgets count rows (n per request) and KV positions (budget_tokens)."""
        tokens = sum(len(r.req.prompt_ids) + r.req.params.max_new_tokens for r in self.batch.rows)
        rows = len(self.batch)
        out: list[GenRequest] = []
        with self._cond:
            while self._waiting:
                req = self._waiting[0]
                if req.handle.cancelled.is_set():
                    self._waiting.popleft()
                    answer_unadmitted(req, "cancelled")
                    continue
                if (rows + req.params.n > self.max_rows or len(out) >= self.max_prefill_rows
                        or tokens + req.budget_tokens > self.max_tokens):
                    break
                self._waiting.popleft()
                self.ledger.open(req)
                tokens += req.budget_tokens
                rows += req.params.n
                out.append(req)
        return out

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self, reqs: list[GenRequest]) -> None:
        now = time.perf_counter()
        if self.metrics is not None:
            for r in reqs:
                self.metrics.queue_wait.observe(now - r.arrival)
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))
        for group in prefill_groups(reqs, self.prefill_padding):
            self._prefill_group(group)

    def _prefill_group(self, reqs: list[GenRequest]) -> None:
        """Prefill once per request, fork n choices, sample their first tokens, join the batch.
        A forward that raises is retried in halves; a request that fails alone fails."""
        hidden_wanted = any(r.params.prompt_logprobs is not None for r in reqs)
        try:
            cache, mask, logits, hidden = self.runner.prefill(reqs, hidden=hidden_wanted)
        except Exception as err:  # noqa: BLE001 - isolate the request that makes it fail
            if len(reqs) == 1:
                log.warning("prefill of %s failed: %s", reqs[0].id, describe(err))
                self._fail_request(reqs[0], f"prefill failed: {describe(err)}")
                return
            log.warning("prefill of %d requests failed (%s); retrying in halves", len(reqs), describe(err))
            mid = len(reqs) // 2
            self._prefill_group(reqs[:mid])
            self._prefill_group(reqs[mid:])
            return
        rows: list[Row] = []
        fork: list[int] = []
        for i, req in enumerate(reqs):
            try:
                prompt_lp = None
                if req.params.prompt_logprobs is not None:
                    assert hidden is not None and len(reqs) == 1, "prompt-logprob requests prefill alone"
                    prompt_lp = prompt_logprobs(hidden[0, hidden.shape[1] - len(req.prompt_ids):],
                                                self.runner.lm_head, req.prompt_ids, req.params.prompt_logprobs,
                                                last_logits=logits[i])
                choices = new_rows(req, self.tokenizer, self.vocab_size, self.runner.device, prompt_lp)
            except Exception as err:  # noqa: BLE001 - fails this request only
                log.warning("request %s failed before its first token: %s", req.id, describe(err))
                self._fail_request(req, describe(err))
                continue
            rows.extend(choices)
            fork.extend([i] * len(choices))
        if not rows:
            return
        if fork != list(range(len(reqs))):  # n > 1 or a failed request: one KV row per choice
            index = torch.tensor(fork, device=mask.device)
            cache, mask = kv.select(cache, mask, index)
            logits = logits.index_select(0, index)
        keep = self._advance(rows, logits)
        if keep:
            new = RunningBatch()
            new.extend(rows, cache, mask)
            new.filter(keep, self.compact_min_padding)
            self.batch.extend(new.rows, new.cache, new.mask)  # type: ignore[arg-type]

    # -- decode --------------------------------------------------------------------------------
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
        try:
            logits = self.runner.decode(self.batch)
        except Exception as err:  # noqa: BLE001 - isolate the rows that make it fail
            logits = self._decode_isolating(err)
            if logits is None:
                return
        self.steps += 1
        keep = self._advance(self.batch.rows, logits)
        self.batch.filter(keep, self.compact_min_padding)

    def _decode_isolating(self, err: Exception) -> torch.Tensor | None:
        """The batched decode raised (and was rolled back): fail the rows that fail alone, decode
        the others again. Returns their logits, or None when no row is left."""
        batch = self.batch
        rows = batch.rows
        log.warning("decode of %d rows failed (%s); isolating", len(rows), describe(err))

        def probe(subset: list[int]) -> bool:  # a forward over a copy of these rows' KV
            assert batch.cache is not None and batch.mask is not None
            cache, mask = kv.select(batch.cache, batch.mask, torch.tensor(subset, device=batch.mask.device))
            try:
                self.runner.forward_decode([rows[i] for i in subset], cache, mask)
                return True
            except Exception:  # noqa: BLE001 - a probe's failure is its answer
                return False

        culprits = set(find_culprits(range(len(rows)), probe))
        for i in sorted(culprits):
            self._fail_row(rows[i], f"forward failed: {describe(err)}")
        batch.filter([i for i in range(len(rows)) if i not in culprits], self.compact_min_padding)
        if not batch.rows:
            return None
        try:
            return self.runner.decode(batch)
        except Exception as again:  # noqa: BLE001 - not about single rows: these rows cannot go on together
            log.error("decode failed again without a single culprit: %s", describe(again))
            for row in batch.rows:
                self._fail_row(row, f"forward failed: {describe(again)}")
            self.batch = RunningBatch()
            return None

    # -- per row -------------------------------------------------------------------------------
    def _advance(self, rows: list[Row], logits: torch.Tensor) -> list[int]:
        """Sample one token per row, emit text, finish rows; returns indices of rows that go on.
        An error in one row fails that row only."""
        sampled = sample_rows(rows, logits)
        now = time.perf_counter()
        keep = []
        for i, row in enumerate(rows):
            try:
                if sampled.errors[i] is not None:
                    self._fail_row(row, sampled.errors[i])  # type: ignore[arg-type]
                elif self._take(row, sampled.tokens[i], sampled.logprobs[i], now):
                    keep.append(i)
            except Exception as err:
                log.exception("row %s choice %d failed", row.req.id, row.index)
                self._fail_row(row, describe(err))
        return keep

    def _take(self, row: Row, token: int, logprob: TokenLogprob | None, now: float) -> bool:
        """Row `row` generated `token`; returns whether it goes on."""
        params = row.req.params
        row.generated += 1
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc()
            if row.generated == 1:
                m.ttft.observe(now - row.req.arrival)
            else:
                m.inter_token.observe(now - row.last_token_at)
        row.last_token_at = now
        row.last_token = token
        if logprob is not None and row.pending_logprobs is not None:
            row.pending_logprobs.append(logprob)
        if row.sampler.processors is not None:
            row.sampler.processors.observe(token)
        if token in self.eos_ids and not params.ignore_eos:
            self._finish(row, "stop")  # the EOS token counts and is reported (logprobs), adds no text
            return False
        text = row.detok.add(token)
        if row.detok.stopped:
            self._finish(row, "stop", text)
        elif row.generated >= params.max_new_tokens or (
            self.max_positions is not None and row.length + 1 >= self.max_positions
        ):
            self._finish(row, "length", text)
        else:
            if text or row.generated == 1:
                row.req.handle.push(TokenEvent(text, token, row.index, row.take_logprobs()))
            return True
        return False

    def _finish(self, row: Row, reason: FinishReason, text: str = "") -> None:
        row.finish = reason
        text += row.detok.flush() if reason != "cancelled" else ""
        self.ledger.send(row.req, FinalEvent(
            text, reason, len(row.req.prompt_ids), row.generated, index=row.index,
            logprobs=row.take_logprobs(), prompt_logprobs=row.prompt_logprobs,
        ))
        elapsed = time.perf_counter() - row.req.arrival
        self._avg_request_s = 0.9 * self._avg_request_s + 0.1 * elapsed

    def _fail_row(self, row: Row, message: str, reason: FinishReason = "cancelled") -> None:
        row.finish = reason
        if self.ledger.owes(row.req, row.index):
            self.ledger.send(row.req, FinalEvent("", reason, len(row.req.prompt_ids), row.generated,
                                                 error=message, index=row.index))

    def _fail_request(self, req: GenRequest, message: str) -> None:
        """Every choice of `req` still owed an answer fails (its prefill failed)."""
        for index in range(req.params.n):
            if self.ledger.owes(req, index):
                self.ledger.send(req, FinalEvent("", "cancelled", len(req.prompt_ids), 0, error=message, index=index))

    def _fail_all(self, message: str, reason: FinishReason = "cancelled") -> None:
        """Last resort: every row in flight (and every admitted choice not yet in the batch)
        fails; the waiting queue is kept and served next."""
        for row in self.batch.rows:
            self._fail_row(row, message, reason)
        self.batch = RunningBatch()
        self.planner.invalidate()
        self.ledger.fail_open(message, reason)

    def _shutdown(self, message: str) -> None:
        """The engine stops: everything admitted or waiting gets its final event."""
        with self._cond:
            self._dead = True
            waiting = list(self._waiting)
            self._waiting.clear()
        try:
            self._fail_all(message)
        finally:
            for req in waiting:
                answer_unadmitted(req, "cancelled", message)
            self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(len(self.batch))
            self.metrics.waiting.set(len(self._waiting))


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
