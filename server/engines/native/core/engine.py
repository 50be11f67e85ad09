"""The engine: one thread running iteration-level continuous batching with chunked prefill.

    loop:
        one background slice (if any, and if within its time share)   add_background_task(fn)
        cancelled rows and prefills leave; their KV slots are freed
        admit waiting requests (scheduler.py: fair order; rows, KV-token and step-token budgets):
            each takes n KV slots and its adapter is written into the first slot's LoRA tables
            (slot_lora.py); its prompt's longest cached prefix is copied into that slot, and
            its chunks start after it (prefix_cache.py)
        one step = one forward (step.py) over what the scheduler plans:
            every decoding row (one token each)                           rows of all tasks
            + prompt chunks of admitted requests, within max_step_tokens  chunked prefill
        a prompt chunk's full blocks go into the prefix cache
        a request whose prompt is complete forks its slot into its n choices, samples their
            first tokens; decoding rows sample their next token
        finished / cancelled rows free their slots at once (slots stay dense: slots.py)
        nothing to do -> sleep until a submit (or run background slices back to back)

The forward never runs on the asyncio loop; results reach it through RequestHandle. A decoding
row never waits for a whole prefill: a step holds at most max_step_tokens tokens, so a long prompt
is spread over several steps while the others keep decoding (vLLM's chunked prefill).

Fault isolation (one bad request fails only itself; every admitted choice gets exactly one
FinalEvent, see ledger.py):
    a row's sampling / detokenisation / stop check / events raise -> that row fails (error final)
    a forward raises   -> nothing was committed (a row's length advances only after its step);
                          bisection over the step's items finds those that fail alone
                          (isolate.py): a decoding row fails, a prompt chunk fails its request;
                          the others run again (once)
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

from adapters_store.lora.inject import RoutedModel
from server.engines.base import EngineStopped, QueueFull, check_fits
from server.engines.fair import TenantLimit, check_caps
from server.engines.native.config import EngineConfig
from server.engines.native.core.execution import Execution
from server.engines.native.core.isolate import find_culprits
from server.engines.native.core.ledger import FinalLedger, answer_unadmitted
from server.engines.native.core.prefix_cache import BLOCK, PrefixCache, chain, namespace
from server.engines.native.core.scheduler import Prefill, Scheduler
from server.engines.native.core.slots import SlotPool
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.model_runner import ModelRunner, build_model_runner
from server.engines.native.sample.logprobs import prompt_chunk_logprobs
from server.engines.native.sample.rows import Row, describe, new_rows, sample_rows, stop_token
from server.engines.request import FinalEvent, FinishReason, GenRequest, TokenEvent, TokenLogprob
from server.infra import cpus, openmp
from server.infra.metrics import Metrics

log = logging.getLogger("polyserve.engine")


class NativeEngine:
    """The embedded engine (server.engines.base.Engine)."""

    name = "native"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, routed_model: RoutedModel | None = None,
                 config: EngineConfig | None = None, *, metrics: Metrics | None = None,
                 runner: ModelRunner | None = None) -> None:
        cfg = self.config = config or EngineConfig()
        self.background_share = cfg.background_share
        self._serve_debt = 0.0  # seconds of serving owed before the next background slice
        self.tokenizer = tokenizer
        self.max_rows, self.max_tokens = cfg.max_batch_rows, cfg.max_batch_tokens
        self.metrics = metrics
        self.runner = runner or build_model_runner(model, routed_model, slots=cfg.max_batch_rows, dtype=cfg.dtype,
                                                   tuning=cfg.tuning)
        self.device = self.runner.device
        lora = self.runner.lora
        log.info("native engine: %s runner, %s, %d slots, %d tokens per step, LoRA %s, decode attention %s, "
                 "linears %s, norms and rope %s",
                 self.runner.name, str(self.runner.dtype).removeprefix("torch."), cfg.max_batch_rows,
                 cfg.max_step_tokens,
                 "none" if lora is None else "in the native kernel" if lora.kernel is not None else "as torch ops",
                 "in the native kernel" if self.runner.attention_kernel else "as SDPA",
                 ("on the backbone's GGUF blocks" if self.runner.weight_kernel
                  else "on dense weights"),
                 "in the native kernel" if self.runner.elementwise else "as torch ops")
        self.pool = SlotPool(cfg.max_batch_rows)
        # prompt KV kept across requests, copied into a row's slot at admission (prefix_cache.py)
        budget = cfg.prefix_cache_budget
        self.prefix = PrefixCache.like(self.runner.kv, budget) if budget else None
        if self.prefix is None:
            log.info("prefix cache: off")
        else:
            log.info("prefix cache: up to %d prompt tokens (%.0f MiB) in blocks of %d, keyed by adapter version, "
                     "tenant and cache_salt", self.prefix.max_blocks * BLOCK,
                     self.prefix.max_blocks * self.prefix.block_bytes / 2**20, BLOCK)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.vocab_size = self.runner.vocab_size
        self.max_positions = self.runner.max_positions
        self.rows: list[Row] = []  # decoding
        self.prefills: list[Prefill] = []  # admitted, prompt not complete (admission order)
        self.ledger = FinalLedger()  # choices admitted and not yet answered
        # waiting requests, one FIFO per tenant, admitted by fair share (scheduler.py, fair.py)
        self.caps = cfg.caps
        self.scheduler = Scheduler(cfg, cached=self._cached if self.prefix is not None else None)
        self._waiting = self.scheduler.waiting
        self._cond = threading.Condition()
        self._background: deque[Callable[[], bool]] = deque()
        self._stop = False
        self._dead = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self._avg_request_s = 1.0
        # the engine thread's torch threads (default: the constructing thread's); the process's only
        # OpenMP pool (server/infra/openmp.py)
        self.threads = cfg.threads or torch.get_num_threads()
        # how each step runs on the CPUs: the whole team alone, one thread (with the weight kernel's
        # panel helper where the runner has it) while other processes hold them (core/execution.py)
        self.execution = Execution.build(self.threads, cpus.budget().usable, cfg.tuning, self.runner.panel_helper,
                                         self.runner.set_mode)

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
        """Queue a request; raises QueueFull (-> 429), TenantLimit (its tenant's cap: fair.py),
        EngineStopped (-> 503) or ValueError (it
        can never run here: over a budget, n over max_batch_rows, a logit_bias token outside
        the vocabulary, prompt + max_new_tokens beyond the model's positions)."""
        check_fits(req, max_tokens=self.max_tokens, max_rows=self.max_rows, vocab_size=self.vocab_size)
        if self.max_positions is not None and len(req.prompt_ids) >= self.max_positions:
            raise ValueError(f"the prompt's {len(req.prompt_ids)} tokens leave no room within the model's "
                             f"{self.max_positions} positions")
        check_caps(req, self.caps, max_rows=self.max_rows, max_tokens=self.max_tokens)
        with self._cond:
            if self._stop or self._dead:
                raise EngineStopped("engine is stopped")
            refused = self._waiting.push(req)
            if refused == "queue":
                raise QueueFull(self.retry_after())
            if refused is not None:
                raise TenantLimit(req.tenant, refused, f"this tenant already has {self._waiting.waiting(req.tenant)} "
                                  "requests waiting (POLYSERVE_TENANT_MAX_QUEUED)", retry_after=self.retry_after())
            self._gauges()
            self._cond.notify_all()
        return req

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained by one batch's worth."""
        batches = (len(self._waiting) + self.running) / max(1, self.max_rows)
        return max(1, math.ceil(batches * self._avg_request_s))

    def add_background_task(self, fn: Callable[[], bool]) -> None:
        """Interleave background work with decoding. `fn()` runs on the engine thread, does one
        short slice of work (say < 100 ms) and returns True while it has more to do. At most one
        slice runs between two steps (round-robin over tasks); with no requests in flight slices
        run back to back. It runs outside inference_mode, on the Hugging Face model (the
        runner's weights are its own copy, so nothing it does changes serving)."""
        with self._cond:
            self._background.append(fn)
            self._cond.notify_all()

    def forget(self, task: str) -> None:
        """Nothing to drop: a row's adapter lives in its slot's tables until the row leaves."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.rows) + sum(p.rows for p in self.prefills)

    # -- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        reason = "server shutting down"
        openmp.use_threads(self.threads)  # this thread's own count: other threads run torch on one (openmp.py)
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._waiting and not self._in_flight() and not self._background:
                        self._cond.wait()
                    if self._stop:
                        break
                self.execution.step()
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
            self.execution.close()
            self._shutdown(reason)

    def _in_flight(self) -> bool:
        return bool(self.rows or self.prefills or self.scheduler.preempted)

    def step(self) -> None:
        """One iteration: a background slice, admissions, one forward over decodes + prompt chunks."""
        self._background_slice()
        started = time.perf_counter()
        with torch.inference_mode():
            self._drop_cancelled()
            self._admit()
            items, owners = self.scheduler.plan_step(self.rows, self.prefills)
            if items:
                self._run_step(items, owners)
            if not self._in_flight():
                self.runner.idle()
        self._serve_debt = max(0.0, self._serve_debt - (time.perf_counter() - started))
        self._gauges()

    def _has_traffic(self) -> bool:
        return bool(self._in_flight() or self._waiting)

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
        if more:
            with self._cond:
                self._background.append(fn)

    # -- admission -----------------------------------------------------------------------------
    def _admit(self) -> None:
        """The scheduler picks what fits (and which rows to preempt for it: they leave their slots
        first); each admitted request's adapter goes into its first slot."""
        with self._cond:
            admission = self.scheduler.admit(self.rows, self.prefills)
        for req in admission.cancelled:
            answer_unadmitted(req, "cancelled")
        for row in admission.cancelled_rows:
            self._finish(row, "cancelled")
        if admission.preempted:
            self._preempt(admission.preempted)
        for prefill in admission.admitted:
            prefill.slots = self.pool.take(prefill, prefill.rows)
            if prefill.resume is None:
                self.ledger.open(prefill.req)
            self.prefills.append(prefill)
        now = time.perf_counter()
        for prefill in admission.admitted:
            req = prefill.req
            if prefill.resume is None:
                if self.metrics is not None:
                    self.metrics.queue_wait.observe(now - req.arrival)
                    self.metrics.prompt_tokens.labels(tenant=req.tenant).inc(len(req.prompt_ids))
                if req.params.prompt_logprobs is not None:
                    prefill.prompt_lp = [None]
            try:
                self.runner.set_adapter(prefill.slots[0], req.adapter)
            except Exception as err:  # noqa: BLE001 - a bad adapter fails its request only
                log.warning("request %s: adapter not usable: %s", req.id, describe(err))
                self._fail_prefill(prefill, f"adapter not usable: {describe(err)}")
                continue
            if self.prefix is not None:
                self._reuse(prefill)
        self._release_failed()

    # -- the prefix cache ----------------------------------------------------------------------
    def _hashes(self, prefill: Prefill) -> list[bytes]:
        if not prefill.hashes:
            req = prefill.req
            prefill.hashes = chain(namespace(getattr(req.adapter, "key", None), req.tenant, req.cache_salt),
                                   prefill.tokens)
        return prefill.hashes

    def _cached(self, prefill: Prefill) -> int:
        """The scheduler's question at admission: prompt tokens the prefix cache holds for it."""
        assert self.prefix is not None
        if prefill.resume is None and prefill.req.params.prompt_logprobs is not None:
            return 0
        return len(self.prefix.peek(self._hashes(prefill), len(prefill.tokens))) * BLOCK

    def _reuse(self, prefill: Prefill) -> None:
        """The prompt's longest cached prefix goes into its slot; its chunks start after it."""
        assert self.prefix is not None
        req = prefill.req
        hashes = self._hashes(prefill)
        if prefill.prompt_lp is not None:
            return  # every prompt position's logits are asked for: nothing may be skipped
        found = self.prefix.match(hashes, len(prefill.tokens))
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.inc(len(prefill.tokens))
            self.metrics.prefix_cache_hits.inc(len(found) * BLOCK)
        if found:
            self.runner.kv.ensure(len(found) * BLOCK, self.max_positions)
            prefill.done = self.prefix.load(found, self.runner.kv, prefill.slots[0])
            prefill.stored = len(found)
        if prefill.resume is None:
            req.cached_tokens = prefill.done

    def _keep(self, prefill: Prefill) -> None:
        """The full blocks the prompt's chunks have now written go into the prefix cache."""
        assert self.prefix is not None
        full = min(len(prefill.hashes), prefill.done // BLOCK)
        if full > prefill.stored:
            self.prefix.store(prefill.hashes[:full], self.runner.kv, prefill.slots[0])
            prefill.stored = full

    # -- one step ------------------------------------------------------------------------------
    def _run_step(self, items: list[Item], owners: list[Row | Prefill]) -> None:
        batch = StepBatch.build(items, self.device)
        if self.metrics is not None and batch.n_decode:
            self.metrics.batch_size.observe(batch.n_decode)
        result = self._forward_isolating(batch, owners)
        if result is not None:
            batch, owners, logits = result
            self.steps += 1
            self._commit(batch, owners, logits)
        self._release_failed()

    def _forward_isolating(self, batch: StepBatch, owners: list[Row | Prefill]):
        """(batch, owners, logits) of the items that ran, after failing those that fail alone."""
        try:
            return batch, owners, self.runner.forward(batch)
        except Exception as err:  # noqa: BLE001 - isolate the items that make it fail
            first = err
        log.warning("forward of %d items failed (%s); isolating", len(owners), describe(first))

        def probe(subset: list[int]) -> bool:
            try:
                self.runner.forward(batch.subset(subset))
                return True
            except Exception:  # noqa: BLE001 - a probe's failure is its answer
                return False

        culprits = set(find_culprits(range(len(owners)), probe))
        for j in sorted(culprits):
            self._fail_owner(owners[j], first)
        keep = [j for j in range(len(owners)) if j not in culprits]
        if not keep:
            return None
        batch, owners = batch.subset(keep), [owners[j] for j in keep]
        try:
            return batch, owners, self.runner.forward(batch)
        except Exception as again:  # noqa: BLE001 - not about single items: these cannot go on together
            log.error("forward failed again without a single culprit: %s", describe(again))
            for owner in owners:
                self._fail_owner(owner, again)
            return None

    def _fail_owner(self, owner: Row | Prefill, err: BaseException) -> None:
        if isinstance(owner, Row):
            self._fail_row(owner, f"forward failed: {describe(err)}")
        else:
            self._fail_prefill(owner, f"prefill failed: {describe(err)}")

    def _commit(self, batch: StepBatch, owners: list[Row | Prefill], logits: torch.Tensor) -> None:
        """The forward succeeded: advance every item, sample the rows that have logits."""
        sample: list[Row] = []
        picks: list[int] = []
        for j, (item, owner) in enumerate(zip(batch.items, owners, strict=True)):
            span = batch.logit_rows[j]
            if isinstance(owner, Row):
                owner.length += 1
                sample.append(owner)
                picks.append(span.start)
                continue
            prefill = owner
            try:
                if prefill.prompt_lp is not None:
                    prefill.prompt_lp.extend(prompt_chunk_logprobs(
                        logits[span], prefill.req.prompt_ids, item.start, prefill.req.params.prompt_logprobs or 0))
                prefill.done = item.end
                if self.prefix is not None:
                    self._keep(prefill)
                if prefill.remaining == 0 and prefill.resume is not None:
                    self._resumed(prefill)  # its pending token is fed next step: nothing to sample
                elif prefill.remaining == 0:
                    rows = self._fork(prefill)
                    sample.extend(rows)
                    picks.extend([span.stop - 1] * len(rows))
            except Exception as err:  # noqa: BLE001 - fails this request only
                log.warning("request %s failed before its first token: %s", prefill.req.id, describe(err))
                self._fail_prefill(prefill, describe(err))
        if sample:
            index = torch.tensor(picks, dtype=torch.long, device=logits.device)
            self._advance(sample, logits.index_select(0, index))  # rows it does not keep are finished

    def _fork(self, prefill: Prefill) -> list[Row]:
        """The prompt is in slots[0]: the n choices become rows (slot i <- a copy of slot 0)."""
        req = prefill.req
        choices = new_rows(req, self.tokenizer, self.vocab_size, self.device, prefill.prompt_lp, self.eos_ids)
        length = len(req.prompt_ids)
        for slot in prefill.slots[1:]:
            self.runner.copy_slot(prefill.slots[0], slot, length)
        # nothing below raises: the prefill's slots now belong to its rows
        self.prefills.remove(prefill)
        for row, slot in zip(choices, prefill.slots, strict=False):
            row.slot = slot
            self.pool.holders[slot] = row
        width = len(prefill.slots)
        self.rows.extend(choices[:width])
        for row in choices[width:]:  # it started split: these wait for a slot (scheduler.py)
            self.scheduler.defer(row)
        return choices

    def _resumed(self, prefill: Prefill) -> None:
        """A preempted row's positions are back in its slot: it decodes on."""
        row = prefill.resume
        assert row.length == prefill.done, (row.length, prefill.done)
        self.prefills.remove(prefill)
        row.slot = prefill.slots[0]
        self.pool.holders[row.slot] = row
        self.rows.append(row)

    def _preempt(self, rows: list[Row]) -> None:
        """The scheduler took these rows back: they leave their slots (their state waits in the
        scheduler, which resumes them by recompute)."""
        gone = {id(r) for r in rows}
        slots = [r.slot for r in rows]
        self.rows = [r for r in self.rows if id(r) not in gone]
        for row in rows:
            row.slot = -1
        self._free_slots(slots)

    # -- per row -------------------------------------------------------------------------------
    def _advance(self, rows: list[Row], logits: torch.Tensor) -> set[int]:
        """Sample one token per row, emit text, finish rows; returns indices of rows that go on
        (the others are finished or failed: `finish` is set). An error in one row fails that row only."""
        sampled = sample_rows(rows, logits)
        now = time.perf_counter()
        keep = set()
        for i, row in enumerate(rows):
            try:
                if sampled.errors[i] is not None:
                    self._fail_row(row, sampled.errors[i])  # type: ignore[arg-type]
                elif self._take(row, sampled.tokens[i], sampled.logprobs[i], now):
                    keep.add(i)
            except Exception as err:
                log.exception("row %s choice %d failed", row.req.id, row.index)
                self._fail_row(row, describe(err))
        return keep

    def _take(self, row: Row, token: int, logprob: TokenLogprob | None, now: float) -> bool:
        """Row `row` generated `token`; returns whether it goes on."""
        params = row.req.params
        row.generated += 1
        row.generated_ids.append(token)
        self._waiting.charge(row.req.tenant, 1)
        m = self.metrics
        if m is not None:
            m.generation_tokens.labels(tenant=row.req.tenant).inc()
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
        if row.sampler.grammar is not None:  # structured output: complete -> "stop"; cannot go on -> "length"
            verdict = row.sampler.grammar.consume(token, token in self.eos_ids)
            if verdict != "go":
                done = verdict == "done" and token not in self.eos_ids
                self._finish(row, "stop" if verdict == "done" else "length", row.detok.add(token) if done else "")
                return False
        if stop_token(params, token, row.generated, self.eos_ids):
            # the stop token counts and is reported (logprobs), adds text only when asked to (vLLM)
            self._finish(row, "stop", row.detok.add(token) if params.include_stop_str_in_output else "")
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
            logprobs=row.take_logprobs(), prompt_logprobs=row.prompt_logprobs, cached_tokens=row.req.cached_tokens,
        ))
        elapsed = time.perf_counter() - row.req.arrival
        self._avg_request_s = 0.9 * self._avg_request_s + 0.1 * elapsed

    def _fail_row(self, row: Row, message: str, reason: FinishReason = "cancelled") -> None:
        row.finish = reason
        if self.ledger.owes(row.req, row.index):
            self.ledger.send(row.req, FinalEvent("", reason, len(row.req.prompt_ids), row.generated,
                                                 error=message, index=row.index))

    def _fail_prefill(self, prefill: Prefill, message: str | None, reason: FinishReason = "cancelled") -> None:
        """Every choice of a request still in prefill ends (its forward failed, or it was
        cancelled: message None); its slots are freed by _release_failed."""
        prefill.failed = True
        req = prefill.req
        if prefill.resume is not None:  # a preempted row coming back: only that choice ends
            if message is None:
                self._finish(prefill.resume, "cancelled")
            else:
                self._fail_row(prefill.resume, message, reason)
            return
        for index in range(req.params.n):
            if self.ledger.owes(req, index):
                self.ledger.send(req, FinalEvent("", reason, len(req.prompt_ids), 0, error=message, index=index))

    def _drop_cancelled(self) -> None:
        """Disconnected clients free their rows before the forward (within one step)."""
        for row in self.rows:
            if row.finish is None and row.req.handle.cancelled.is_set():
                self._finish(row, "cancelled")
        for prefill in self.prefills:
            if not prefill.failed and prefill.req.handle.cancelled.is_set():
                self._fail_prefill(prefill, None)
        self._release_failed()

    def _release_failed(self) -> None:
        """Rows that finished and prefills that failed leave; their slots are freed (a higher
        slot's holder moves down into each, data and adapter tables copied)."""
        gone = [r.slot for r in self.rows if r.finish is not None]
        gone += [s for p in self.prefills if p.failed for s in p.slots]
        if not gone:
            return
        self.rows = [r for r in self.rows if r.finish is None]
        self.prefills = [p for p in self.prefills if not p.failed]
        self._free_slots(gone)

    def _free_slots(self, gone: list[int]) -> None:
        """Free these slots; a higher slot's holder moves down into each (data and adapter tables)."""
        for slot in sorted(gone, reverse=True):  # highest first: a freed slot is never a move's source
            move = self.pool.free(slot)
            if move is None:
                continue
            src, dst, holder = move
            if isinstance(holder, Row):
                self.runner.copy_slot(src, dst, holder.length)
                holder.slot = dst
            else:
                assert isinstance(holder, Prefill)
                k = holder.slots.index(src)
                if k == 0:
                    self.runner.copy_slot(src, dst, holder.done)
                holder.slots[k] = dst

    def _fail_all(self, message: str, reason: FinishReason = "cancelled") -> None:
        """Last resort: every row in flight (and every admitted choice not yet in a row) fails;
        the waiting queue is kept and served next."""
        for row in self.rows:
            self._fail_row(row, message, reason)
        self.rows = []
        self.prefills = []
        self.scheduler.preempted.clear()  # owed finals: ledger.fail_open below
        self.pool = SlotPool(self.max_rows)
        self.ledger.fail_open(message, reason)

    def _shutdown(self, message: str) -> None:
        """The engine stops: everything admitted or waiting gets its final event."""
        with self._cond:
            self._dead = True
            waiting = self._waiting.drain()
        try:
            self._fail_all(message)
        finally:
            for req in waiting:
                answer_unadmitted(req, "cancelled", message)
            self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(self.running)
            self.metrics.waiting.set(len(self._waiting))
            if self.prefix is not None:
                self.metrics.prefix_cache_blocks.set(len(self.prefix))


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
