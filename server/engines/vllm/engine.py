"""The vLLM engine (`POLYSERVE_ENGINE=vllm`): vLLM's in-process async engine (V1 `AsyncLLM`) behind
polyserve's Engine interface (server.engines.base), so every endpoint, limit, metric and the
registration API stay the same while vLLM does the batching (paged attention, punica LoRA kernels,
CUDA graphs, tensor parallelism through POLYSERVE_VLLM_ARGS).

    submit(req)       -> a coroutine on the engine's own asyncio loop (a thread):
                         adapter (already resolved by L1 -> Redis -> store) -> PEFT directory
                         written once per cache key (lora_dirs.py) -> LoRARequest(stable id)
                         `base` -> no LoRA
                         AsyncLLM.generate(token ids, DELTA outputs) -> TokenEvents, one
                         FinalEvent per choice, whatever happens (errors become error finals)
    handle.cancel()   -> a sweeper cancels the request's coroutine within 20 ms; vLLM aborts it
    forget(task)      -> the task's LoRA ids are removed from vLLM (deleted / re-registered)
    background tasks  -> adaptation slices run back to back on a worker thread, on the Hugging
                         Face copy of the backbone (gradients), with a bounded number of torch
                         threads; a succeeded job's task is servable at once (its adapter is a
                         new cache key, hence a new LoRA)

Queue accounting: vLLM schedules internally; polyserve counts requests in flight, reports
min(in flight, max_batch_rows) as running and the rest as waiting, and answers 429 once more than
max_queue are waiting, as the native engine does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from adapters_store.store.records import InventoryInfo
from server.engines.base import EngineStopped, QueueFull, check_fits
from server.engines.fair import TenantCaps, check_submit_caps
from server.engines.request import FinalEvent, GenRequest, TokenEvent, TokenLogprob
from server.engines.vllm.lora_dirs import LoraDirectories
from server.engines.vllm.params import cache_salt, vllm_kwargs
from server.engines.vllm.structured import structured_kwargs
from server.infra.metrics import Metrics

log = logging.getLogger("polyserve.engine.vllm")

FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
CANCEL_POLL = 0.02


def token_logprobs(ids: list[int], entries: list[Any] | None, k: int) -> list[TokenLogprob] | None:
    """vLLM's per-position {token id: Logprob(logprob, rank)} -> TokenLogprob with the k most likely."""
    if entries is None:
        return None
    out = []
    for tid, entry in zip(ids, entries, strict=False):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        top = tuple((int(t), float(lp.logprob)) for t, lp in ranked if lp.rank is not None and lp.rank <= k)[:k]
        out.append(TokenLogprob(int(tid), float(entry[tid].logprob), top))
    return out


class VllmEngine:
    """server.engines.base.Engine on vLLM's AsyncLLM."""

    name = "vllm"

    def __init__(
        self, model_dir: str, tokenizer: Any, *, lora_root: str | None = None, inventory: InventoryInfo | None = None,
        max_batch_rows: int = 32, max_batch_tokens: int = 16384, max_queue: int = 256, dtype: str = "float32",
        metrics: Metrics | None = None, extra_args: dict[str, Any] | None = None, background_threads: int = 1,
        max_model_len: int | None = None, caps: TenantCaps | None = None,
    ) -> None:
        self.caps = caps or TenantCaps()  # per-tenant caps, applied before a request reaches vLLM (fair.py)
        self.model_dir, self.tokenizer, self.metrics = model_dir, tokenizer, metrics
        self.max_rows, self.max_tokens, self.max_queue = max_batch_rows, max_batch_tokens, max_queue
        self.loras = LoraDirectories(lora_root, inventory, model_dir) if inventory is not None and lora_root else None
        args: dict[str, Any] = {
            "model": model_dir, "tokenizer": model_dir, "dtype": dtype, "max_num_seqs": max_batch_rows,
            "seed": 0, "disable_log_stats": True,
        }
        if max_model_len:
            args["max_model_len"] = max_model_len
        if self.loras is not None and inventory is not None:
            args.update(enable_lora=True, max_lora_rank=_vllm_rank(inventory.spec.rank),
                        max_loras=min(max_batch_rows, 16), max_cpu_loras=max(64, max_batch_rows))
        args.update(extra_args or {})  # POLYSERVE_VLLM_ARGS wins (tensor_parallel_size, ...)
        self.engine_args = args
        self.background_threads = background_threads
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[GenRequest, asyncio.Task | None]] = {}
        self._stopping = False
        self._dead = False
        self._background: deque[Callable[[], bool]] = deque()
        self._bg_cond = threading.Condition()
        self._bg_thread: threading.Thread | None = None
        self._loaded: set[int] = set()  # LoRA ids vLLM has been given
        self._cancel_reason: dict[str, str] = {}  # request id -> error message (shutdown), else a plain cancel
        self._avg_request_s = 1.0
        self.vocab_size = len(tokenizer)

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Build vLLM's engine on its own loop thread; returns once it is ready (or raises)."""
        if self._thread is not None:
            return
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name="polyserve-vllm", daemon=True)
        self._thread.start()
        ready.result()  # raises what building the engine raised
        self._bg_thread = threading.Thread(target=self._run_background, name="polyserve-vllm-jobs", daemon=True)
        self._bg_thread.start()

    def _run_loop(self, ready: Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
            log.info("vLLM engine ready: %s", {k: v for k, v in self.engine_args.items() if k != "tokenizer"})
        except BaseException as err:  # noqa: BLE001 - reported to start()
            self._dead = True
            ready.set_exception(err)
            loop.close()
            return
        ready.set_result(True)
        sweeper = loop.create_task(self._sweep_cancelled())
        try:
            loop.run_forever()
        finally:
            self._dead = True
            sweeper.cancel()
            with self._lock:
                for req_id in self._inflight:  # still owed an answer: they fail with the reason
                    self._cancel_reason.setdefault(req_id, "server shutting down")
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            llm, self._llm = self._llm, None
            try:
                llm.shutdown()
            except Exception:
                log.exception("vLLM shutdown failed")
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Let requests in flight finish (up to `timeout`), then shut vLLM down; what is left is
        answered 'server shutting down'."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._bg_cond:
            self._bg_cond.notify_all()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for req_id in list(self._inflight):
                self._cancel_soon(req_id, "server shutting down")
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout + 30)
        self._dead = True

    # -- Engine interface --------------------------------------------------------------------------
    def submit(self, req: GenRequest) -> GenRequest:
        check_fits(req, max_tokens=self.max_tokens, max_rows=self.max_rows, vocab_size=self.vocab_size)
        with self._lock:
            if self._stopping or self._dead or self._loop is None:
                raise EngineStopped("engine is stopped")
            if not self.caps.fair and self.waiting >= self.max_queue:
                raise QueueFull(self.retry_after())
            check_submit_caps(req, self.caps, [r for r, _ in self._inflight.values()], max_queue=self.max_queue,
                              max_rows=self.max_rows, max_tokens=self.max_tokens, retry_after=self.retry_after())
            self._inflight[req.id] = (req, None)
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(tenant=req.tenant).inc(len(req.prompt_ids))
        self._gauges()
        asyncio.run_coroutine_threadsafe(self._serve(req), self._loop)
        return req

    def retry_after(self) -> int:
        batches = len(self._inflight) / max(1, self.max_rows)
        return max(1, int(batches * self._avg_request_s + 0.999))

    def add_background_task(self, fn: Callable[[], bool]) -> None:
        with self._bg_cond:
            self._background.append(fn)
            self._bg_cond.notify_all()

    def forget(self, task: str) -> None:
        """A deleted or re-registered task: its LoRAs leave vLLM (a new version is a new id)."""
        if self.loras is None or self._loop is None or self._dead:
            return
        ids = self.loras.pop_task(task)
        if ids:
            asyncio.run_coroutine_threadsafe(self._remove_loras(ids), self._loop)

    @property
    def waiting(self) -> int:
        return max(0, len(self._inflight) - self.max_rows)

    @property
    def running(self) -> int:
        return min(len(self._inflight), self.max_rows)

    @property
    def alive(self) -> bool:
        llm = self._llm
        return (not self._dead and self._thread is not None and self._thread.is_alive()
                and llm is not None and not getattr(llm, "errored", False))

    # -- on the engine loop -----------------------------------------------------------------------
    async def _serve(self, req: GenRequest) -> None:
        """One request from submit to its last FinalEvent; every choice gets exactly one final."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        with self._lock:
            self._inflight[req.id] = (req, asyncio.current_task())
        finals: set[int] = set()
        counts = [0] * req.params.n
        prompt_lps: list[TokenLogprob | None] | None = None
        started = time.perf_counter()
        first = True
        try:
            if req.handle.cancelled.is_set():
                raise asyncio.CancelledError
            lora = await self._lora_request(req.adapter)
            params = VSamplingParams(**vllm_kwargs(req.params), **structured_kwargs(req.params),
                                     output_kind=RequestOutputKind.DELTA)
            # vLLM's prefix cache keys blocks by the LoRA (its name names the adapter's version:
            # lora_dirs.py) and this salt: a tenant reuses only its own prompts' KV, as natively
            prompt = {"prompt_token_ids": list(req.prompt_ids), "cache_salt": cache_salt(req)}
            cached = 0
            async for out in self._llm.generate(prompt, params, request_id=req.id, lora_request=lora):
                if first and self.metrics is not None:
                    self.metrics.queue_wait.observe(time.perf_counter() - req.arrival)
                first = False
                cached = getattr(out, "num_cached_tokens", None) or cached
                if out.prompt_logprobs is not None and prompt_lps is None:
                    prompt_lps = [None] + (token_logprobs(req.prompt_ids[1:], out.prompt_logprobs[1:],
                                                          req.params.prompt_logprobs or 0) or [])
                for c in out.outputs:
                    if c.index in finals:
                        continue
                    ids = list(c.token_ids)
                    counts[c.index] += len(ids)
                    lps = (token_logprobs(ids, c.logprobs, req.params.logprobs or 0)
                           if req.params.logprobs is not None else None)
                    if c.finish_reason is None:
                        if ids or c.text:
                            req.handle.push(TokenEvent(c.text, ids[-1] if ids else -1, c.index, lps))
                        continue
                    finals.add(c.index)
                    reason = FINISH.get(c.finish_reason, "stop")
                    req.handle.push(FinalEvent(c.text, reason, len(req.prompt_ids), counts[c.index], index=c.index,  # type: ignore[arg-type]
                                               logprobs=lps, prompt_logprobs=prompt_lps, cached_tokens=cached))
        except asyncio.CancelledError:
            message = self._cancel_reason.pop(req.id, None)
            self._answer_rest(req, finals, counts, "cancelled", message)
        except Exception as err:
            log.exception("vLLM request %s failed", req.id)
            self._answer_rest(req, finals, counts, "cancelled", f"vLLM engine error: {type(err).__name__}: {err}")
        else:
            self._answer_rest(req, finals, counts, "cancelled", "vLLM ended the request without a final output")
        finally:
            with self._lock:
                self._inflight.pop(req.id, None)
            elapsed = time.perf_counter() - started
            self._avg_request_s = 0.9 * self._avg_request_s + 0.1 * elapsed
            self._gauges()

    def _answer_rest(self, req: GenRequest, finals: set[int], counts: list[int], reason: str,
                     error: str | None) -> None:
        for index in range(req.params.n):
            if index not in finals:
                finals.add(index)
                # a client-side cancel is not an error; anything else carries its message
                req.handle.push(FinalEvent("", reason, len(req.prompt_ids), counts[index], error=error, index=index))  # type: ignore[arg-type]

    async def _lora_request(self, adapter: Any) -> Any:
        if adapter is None:
            return None
        if self.loras is None:
            raise RuntimeError("this vLLM engine was started without an inventory; only `base` is served")
        from vllm.lora.request import LoRARequest

        name, lora_id, path = await asyncio.to_thread(self.loras.ensure, adapter)
        self._loaded.add(lora_id)
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path))

    async def _remove_loras(self, ids: set[int]) -> None:
        for lora_id in ids:
            if lora_id in self._loaded:
                self._loaded.discard(lora_id)
                try:
                    await self._llm.remove_lora(lora_id)
                except Exception:
                    log.debug("remove_lora(%d) failed", lora_id, exc_info=True)

    def _cancel_soon(self, req_id: str, message: str | None = None) -> None:
        if message:
            self._cancel_reason[req_id] = message
        with self._lock:
            entry = self._inflight.get(req_id)
        if entry is not None and entry[1] is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(entry[1].cancel)

    async def _sweep_cancelled(self) -> None:
        """Requests whose client went away (handle.cancel()) leave vLLM within CANCEL_POLL."""
        while True:
            await asyncio.sleep(CANCEL_POLL)
            with self._lock:
                gone = [task for req, task in self._inflight.values()
                        if task is not None and req.handle.cancelled.is_set()]
            for task in gone:
                task.cancel()  # AsyncLLM.generate aborts the request in vLLM on cancellation

    # -- background work (adaptation) ------------------------------------------------------------
    def _run_background(self) -> None:
        import torch

        torch.set_num_threads(self.background_threads)
        while True:
            with self._bg_cond:
                while not self._background and not self._stopping:
                    self._bg_cond.wait()
                if self._stopping:
                    return
                fn = self._background.popleft()
            try:
                more = bool(fn())
            except Exception:
                log.exception("background task failed; removed")
                more = False
            if more:
                with self._bg_cond:
                    self._background.append(fn)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(self.running)
            self.metrics.waiting.set(self.waiting)


def _vllm_rank(rank: int) -> int:
    """vLLM accepts max_lora_rank from a fixed set; the smallest one >= the inventory's rank."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if allowed >= rank:
            return allowed
    return rank
