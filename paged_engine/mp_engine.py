"""``LLM``'s engine with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the engine core (model, KV
pool, scheduler) in a process of its own, the one ``serve`` runs (``core_process.py``),
driven by offline ``generate``. This process keeps the tokenizer and config.json, no
weights (as vLLM V1's ``LLM`` by default), so nothing it does meanwhile slows a step.

Every request is checked here with the in-process engine's own functions
(``engine/inputs.py``: the same refusals, naming ``prompt i``) before anything is sent;
then all of a call's requests go to the core in one add (all or none), each asking for
its final output only, which equals the in-process engine's, under the same request ids.

Why a private event loop on a thread: ``CoreClient`` (the server's) hands each request's
events to an asyncio queue of one running loop, and the caller may have no loop or its
own. A relay coroutine there moves the events to a thread-safe queue the calling thread
reads, so a Ctrl-C lands in the calling thread: its ``KeyboardInterrupt`` cancels the
relay, which aborts the call's requests in the core after their add (never before it,
or they would run on), and the engine is idle again.

Faults: a core that dies makes ``generate`` raise a RuntimeError naming its death, and
every later call too (no restart: build a new ``LLM``). A request the core fails alone
(fault isolation) raises a RuntimeError naming it, the call's others aborted; the engine
stays usable. Both carry the finished outputs as ``partial_outputs``, as in process.

Not here: ``add_request``/``step``, ``reset_prefix_cache`` (the core has no command for
it), ``last_run_stats`` (None: the core's counters are not sent per call), ``model_runner``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field, fields, replace
from multiprocessing.util import Finalize
from typing import Any

from tqdm.auto import tqdm

from paged_engine.config import EngineConfig
from paged_engine.engine.batch import attach_partial_outputs, pair_prompts
from paged_engine.engine.inputs import check_request, parse_params, parse_prompt
from paged_engine.engine.request import RequestOutput
from paged_engine.engine.stats import RunStats
from paged_engine.engine_args import EngineArgs
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreInfo, CoreSpec
from paged_engine.entrypoints.loop_types import EngineSnapshot, Event, RequestFailed
from paged_engine.llm_engine import read_model
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker.devices import resolve_device

__all__ = ["MultiprocessLLMEngine"]

Requests = list[tuple[str, object, SamplingParams]]
STOP_WAIT_S = 10.0
"""``close``: how long the core may take to stop before it is terminated, then killed."""
RELAY_WAIT_S = 5.0
"""After an interruption: how long ``generate`` waits for the relay to send the abort."""


@dataclass(slots=True)
class _Ended:
    """The relay's last item when it ended early: what ``submit`` raised."""

    error: BaseException


@dataclass(slots=True, eq=False)
class _Call:
    """One ``generate`` as the calling thread and the relay share it. ``started`` and
    ``cancelled`` are read and set under ``lock``: an interrupted call waits for the
    relay's abort only if the relay started (else it never sends the add at all)."""

    requests: Requests
    events: queue.SimpleQueue[Event | _Ended] = field(default_factory=queue.SimpleQueue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False
    cancelled: bool = False
    relayed: threading.Event = field(default_factory=threading.Event)
    """Set once the relay has ended, its abort sent."""


def core_kwargs(engine_args: EngineArgs) -> dict[str, Any]:
    """``engine_args`` as the core's ``engine_args_from_kwargs`` takes them (vLLM's names)."""
    return {f.name: getattr(engine_args, f.name) for f in fields(engine_args) if f.name != "model"}


def _new_client(spec: CoreSpec, tokenizer: Any, load_timeout: float) -> CoreClient:
    """The core's client, making the text in this process with ``tokenizer``."""
    client = CoreClient(spec, load_timeout=load_timeout)
    client.streams.use_tokenizer(tokenizer)
    return client


def _shutdown(client: CoreClient, aloop: asyncio.AbstractEventLoop, thread: Any) -> None:
    """End the core process (asked, then terminated, then killed) and the loop thread."""
    try:
        client.stop(STOP_WAIT_S)
    finally:
        if not aloop.is_closed():
            aloop.call_soon_threadsafe(aloop.stop)
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(STOP_WAIT_S)  # (garbage collection may run this on the loop's)
            if not thread.is_alive():
                aloop.close()


class MultiprocessLLMEngine:
    """See the module docstring. Built by ``LLM`` from its ``EngineArgs``: the arguments
    and the model directory are checked here first (``read_model``, as the in-process
    engine does), then the core is started and its model loaded (what it refuses is
    raised here). ``close()`` ends the core; so do garbage collection and interpreter
    exit (a ``multiprocessing`` finalizer, run before it waits for child processes)."""

    model_runner: None = None
    """No runner in this process: the model is in the core's."""

    def __init__(self, engine_args: EngineArgs, *, load_timeout: float = 600.0) -> None:
        files = read_model(engine_args)
        self.model_config: ModelConfig = files.model_config
        """config.json and generation_config.json, read here as by the core."""
        self.hf_tokenizer: Any = files.tokenizer
        self.vocab_size = files.model_config.vocab_size
        self.eos_token_ids: tuple[int, ...] = files.eos_token_ids or ()
        spec = CoreSpec(str(engine_args.model), core_kwargs(engine_args))
        self._client = _new_client(spec, files.tokenizer, load_timeout)
        self.info: CoreInfo = self._client.launch()
        """What the core reported once loaded (its pid, its pool's size)."""
        self._aloop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._aloop.run_forever, name="mp-engine", daemon=True)
        self._finalizer = Finalize(
            self, _shutdown, args=(self._client, self._aloop, thread), exitpriority=10
        )
        try:
            thread.start()
            self._client.start(self._aloop)
            device = resolve_device(files.config.device).type
        except BaseException:
            self._finalizer()
            raise
        self.num_blocks = self.info.num_blocks
        self.config: EngineConfig = replace(
            files.config, max_model_len=self.info.max_model_len
        ).for_device(device)
        """The config the core runs with: its ``max_model_len``, the device's defaults
        filled in as its runner fills them."""
        self.last_run_stats: RunStats | None = None
        """Always None here: the core's counters are not reported per call."""
        self._next_id = 0
        self._closed = False

    # ---- what LLM calls ---------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.hf_tokenizer

    @property
    def core_pid(self) -> int:
        """The engine core process's id."""
        return self.info.pid

    @property
    def snapshot(self) -> EngineSnapshot | None:
        """The core's counters as it last published them (sequences running, waiting)."""
        return self._client.snapshot

    def close(self) -> None:
        """End the core process and the loop thread (idempotent); later calls raise."""
        self._closed = True
        self._finalizer()

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError(
            "reset_prefix_cache is not available in multiprocess mode "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=1): the engine core process has no command "
            "for it"
        )

    def generate(
        self, prompts: object, params: object = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """As the in-process ``LLMEngine.generate``: outputs in input order; every request
        checked before any is sent (the same refusals). See the module docstring for
        what a Ctrl-C, a failed request or the core's death does."""
        self._check_usable()
        pairs = pair_prompts(prompts, params)
        requests = [
            self._checked(str(self._next_id + i), p, sp, f"prompt {i}")
            for i, (p, sp) in enumerate(pairs)
        ]
        self._next_id += len(requests)
        return self._run(_Call(requests), use_tqdm)

    # ---- the call --------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed")
        if not self._client.alive:
            raise RuntimeError(self._death())

    def _death(self) -> str:
        why = self._client.fatal or f"the engine core process (pid {self.core_pid}) has exited"
        return f"{why}; multiprocess mode does not restart it: build a new LLM"

    def _checked(
        self, request_id: str, prompt: object, params: object, where: str
    ) -> tuple[str, object, SamplingParams]:
        """The request as the core gets it, refused here as the in-process engine would
        refuse it: its token ids (with the text they came from and the cache salt), its
        own copy of the params, asking for the final output only."""
        tok = self.hf_tokenizer
        parsed = parse_prompt(prompt, tok, self.vocab_size, where)
        sp = parse_params(params, where)
        check_request(
            parsed.token_ids,
            sp,
            self.config,
            self.num_blocks,
            where,
            has_tokenizer=tok is not None,
            vocab_size=self.vocab_size,
            tokenizer=tok,
        )
        sent: dict[str, object] = {"prompt_token_ids": parsed.token_ids}
        if parsed.text is not None:
            sent["prompt"] = parsed.text
        if parsed.cache_salt is not None:
            sent["cache_salt"] = parsed.cache_salt
        return request_id, sent, replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)

    def _run(self, call: _Call, use_tqdm: bool) -> list[RequestOutput]:
        ids = [r[0] for r in call.requests]
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, dynamic_ncols=True)
        future: Any = None
        try:
            future = asyncio.run_coroutine_threadsafe(self._relay(call), self._aloop)
            while len(outputs) < len(ids):
                item = call.events.get()
                if isinstance(item, _Ended):
                    if not self._client.alive:
                        raise RuntimeError(self._death()) from item.error
                    raise item.error
                if isinstance(item, RequestFailed):
                    if not self._client.alive:
                        raise RuntimeError(f"generate failed: {self._death()}")
                    raise RuntimeError(
                        f"request {item.request_id} failed in the engine core: {item.message}"
                    )
                if item.finished:
                    outputs[item.request_id] = item
                    bar.update(1)
            return [outputs[r] for r in ids]
        except BaseException as exc:
            with call.lock:
                call.cancelled = True
                started = call.started
            if future is not None:
                future.cancel()  # the relay aborts what it added
            if started:
                call.relayed.wait(RELAY_WAIT_S)
            attach_partial_outputs(exc, [outputs[r] for r in ids if r in outputs])
            raise
        finally:
            bar.close()

    async def _relay(self, call: _Call) -> None:
        """On the loop thread: add the call's requests, then move their events to the
        calling thread until each has ended; when cancelled (or refused), abort those
        that have not, after the add went out."""
        with call.lock:
            if call.cancelled:
                return
            call.started = True
        open_ids = {r[0] for r in call.requests}
        try:
            sink = await self._client.submit(call.requests, time.time())
            while open_ids and not call.cancelled:
                event = await sink.get()
                call.events.put(event)
                if isinstance(event, RequestFailed) or event.finished:
                    open_ids.discard(event.request_id)
        except Exception as exc:  # refused by the core, or the core is gone
            call.events.put(_Ended(exc))
        finally:
            if open_ids:
                self._client.abort(sorted(open_ids))
            call.relayed.set()
