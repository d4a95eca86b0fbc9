"""``LLM``: the user-facing entry point, shaped like vLLM's offline API.

``LLM(model).generate(prompts, sampling_params)`` and ``LLM.chat(messages)``, with vLLM's
argument names, so that porting a script is a matter of changing the import.

With ``tensor_parallel_size=N`` the model is sharded over ``N`` ranks: this process and
``N - 1`` spawned workers (``worker/tp_worker.py``). ``close()``, a ``with`` block, garbage
collection or interpreter exit ends them.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's variable; here the default is 0) the
engine core runs in a process of its own, as ``serve`` runs it (``mp_engine.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from paged_engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from paged_engine.chat_messages import template_messages
from paged_engine.engine.request import RequestOutput
from paged_engine.engine.stats import RunStats
from paged_engine.engine_args import engine_args_from_kwargs
from paged_engine.llm_engine import LLMEngine, model_dir_of, refuse_lora
from paged_engine.mp_engine import MultiprocessLLMEngine
from paged_engine.pooling import EmbeddingRequestOutput, PoolingRequestOutput, embed, encode
from paged_engine.sampling_params import SamplingParams
from paged_engine.score import ScoringRequestOutput, score
from paged_engine.utils.generation_defaults import default_sampling_values
from paged_engine.worker.model_runner import ModelRunner

__all__ = ["LLM", "MULTIPROCESSING_ENV", "model_dir_of", "multiprocessing_enabled"]

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's variable: 1 runs ``LLM``'s engine core in a process of its own, 0 or unset (the
default here, where vLLM's is 1) in this process."""


def multiprocessing_enabled() -> bool:
    """``VLLM_ENABLE_V1_MULTIPROCESSING`` read: True for "1", False for "0", "" or unset;
    any other value is a ValueError naming the variable. (An engine core builds its engine
    with ``LLMEngine.from_engine_args``, which never reads it.)"""
    raw = os.environ.get(MULTIPROCESSING_ENV, "")
    if raw.strip() not in ("", "0", "1"):
        raise ValueError(
            f"{MULTIPROCESSING_ENV}={raw!r}: use 1 (the engine core in a process of its "
            "own) or 0 (in this process, the default)"
        )
    return raw.strip() == "1"


class LLM:
    """A model from a local Hugging Face-format directory or .gguf file, served by the paged
    engine.

    ``model`` is the directory (a hub name is refused with a message saying how to fetch
    it); ``tokenizer`` another directory holding the tokenizer (default: ``model``). The
    keywords are ``EngineArgs``' fields (vLLM's names, each documented there), and
    ``EngineConfig``'s names where they differ (``kvcache_block_size`` for
    ``block_size``, ``num_kvcache_blocks`` for ``num_gpu_blocks_override``,
    ``kv_cache_memory`` for ``kv_cache_memory_bytes``); an unknown one is a TypeError
    listing the known ones. The engine is built by ``LLMEngine.from_engine_args``, the
    one path from arguments to an engine.

    Construction validates everything (device, config.json, attention backend, pool size,
    checkpoint) before a weight is read or the model or the KV pool is allocated; only a
    pool sized from CUDA memory (no ``num_kvcache_blocks``) is checked after the weights
    load, as its budget is measured with the loaded model. ``max_model_len`` may not
    exceed the model's ``max_position_embeddings``; when not given it is
    ``EngineConfig``'s default capped at that. ``self.config`` holds the values the engine
    runs with. Generation stops at every eos id: generation_config.json's (as transformers'
    ``generate``), else config.json's, else the tokenizer's.

    ``tensor_parallel_size=N`` starts ``N - 1`` worker processes (refused first when the
    model's heads, KV heads, intermediate size or vocabulary do not divide by ``N``).
    Call ``close()`` or use ``with LLM(...) as llm:`` to end them; they also end when the
    ``LLM`` is garbage collected or the interpreter exits. A worker that fails (raises,
    dies, or stops for longer than the collective timeout, ``PAGED_ENGINE_TP_TIMEOUT_S``,
    a minute by default) makes the step raise (``WorkerError``) and closes the ``LLM``;
    so does a Ctrl-C during a step, which is taken at once.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment runs the engine core (model,
    KV pool, scheduler) in a process of its own and only the tokenizer here
    (``mp_engine.MultiprocessLLMEngine`` as ``llm_engine``; see there what it offers):
    ``generate`` and ``chat`` give the same outputs; ``model_runner`` is None,
    ``last_run_stats`` None, ``reset_prefix_cache`` raises NotImplementedError.
    ``close()``, a ``with`` block, garbage collection or interpreter exit end the core.
    """

    def __init__(
        self, model: str | Path, *, tokenizer: str | Path | None = None, **kwargs: Any
    ) -> None:
        engine_args = engine_args_from_kwargs(model, tokenizer, kwargs)
        self._closed = False
        self.model_runner: ModelRunner | None = None
        """The model's runner; None when the engine core runs in another process."""
        if multiprocessing_enabled():
            # Typed as the default engine: this one has what LLM calls of an engine.
            engine = MultiprocessLLMEngine(engine_args)
            self.llm_engine = cast(LLMEngine, engine)
        else:
            self.llm_engine = LLMEngine.from_engine_args(engine_args)
            self.model_runner = self.llm_engine.model_runner
        self.tokenizer = self.llm_engine.get_tokenizer()
        self.config = self.llm_engine.config
        """The engine config with the device's defaults filled in (by the runner)."""
        self._default_sampling: dict[str, Any] | None = None

    def close(self) -> None:
        """End the tensor-parallel workers (if any), or the engine core process;
        afterwards ``generate`` and ``chat`` raise. Idempotent."""
        self._closed = True
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed")

    @property
    def engine(self) -> LLMEngine:
        """``llm_engine`` (vLLM's name), under its earlier name."""
        return self.llm_engine

    def get_default_sampling_params(self) -> SamplingParams:
        """A new ``SamplingParams`` from the model's generation_config.json (``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens`` as
        ``max_tokens``), the plain defaults for the rest, as vLLM builds it; what
        ``generate`` and ``chat`` use when given no params. A new record each call, so
        changing it changes no later default. The file is read once."""
        if self._default_sampling is None:
            model_dir = self.llm_engine.model_config.model_dir
            self._default_sampling = default_sampling_values(model_dir)
        return SamplingParams(**self._default_sampling)

    def generate(
        self,
        prompts: object,
        sampling_params: object = None,
        *,
        use_tqdm: bool = True,
        lora_request: object = None,
    ) -> list[RequestOutput]:
        """Complete one prompt or a list (text, token ids, a ``TextPrompt`` ``{"prompt":
        ...}`` or a ``TokensPrompt`` ``{"prompt_token_ids": ...}``, optionally with
        ``"cache_salt"``) with one ``SamplingParams`` or a list of them (default:
        ``get_default_sampling_params()``). Outputs in input order. Every request is
        validated before any runs, its params copied (a later change to them reaches no
        request); ``lora_request`` must be None. See ``LLMEngine.generate`` for what
        happens when a step fails."""
        self._check_open()
        refuse_lora(lora_request)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self.llm_engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: object,
        sampling_params: object = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: object = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Complete one conversation (a list of ``{"role", "content"}`` messages) or a list
        of them, rendered with the tokenizer's chat template (or ``chat_template``), which
        is shown ``tools`` (OpenAI's function tool objects), as vLLM's. Messages go
        through ``chat_messages.template_message`` (vLLM's ``reasoning`` fields)."""
        refuse_lora(lora_request)
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat() needs a tokenizer; this model directory has none")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template: pass chat_template=, or use generate()"
            )
        if not isinstance(messages, list | tuple) or not messages:
            raise TypeError("messages must be a non-empty list of messages or of conversations")
        if tools is not None and (
            not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise TypeError(f"tools must be a list of tool dicts, got {tools!r}")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        rendered_convs = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list | tuple) or not all(isinstance(m, Mapping) for m in conv):
                raise TypeError(f"conversation {i} must be a list of message dicts")
            rendered_convs.append(template_messages(list(conv)))
        prompts = []
        for conv in rendered_convs:
            rendered = tok.apply_chat_template(
                conv,
                tools=list(tools) if tools is not None else None,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: object,
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (``beam_search.py``): for each prompt (text, token ids, a
        ``TextPrompt`` or ``TokensPrompt``; one or a list), the best ``beam_width`` beams,
        best first. The beams share blocks through the prefix cache."""
        self._check_open()
        refuse_lora(lora_request)
        batch = list(prompts) if isinstance(prompts, list | tuple) else [prompts]
        if batch and all(isinstance(t, int) for t in batch):  # one prompt's token ids
            batch = [batch]
        return beam_search(
            lambda ps, sp: self.generate(ps, sp, use_tqdm=use_tqdm),
            batch,
            params,
            eos_token_ids=self.llm_engine.eos_token_ids,
            tokenizer=self.tokenizer,
            max_model_len=self.config.max_model_len,
        )

    def embed(
        self, prompts: object, pooling_params: object = None, *, use_tqdm: bool = False
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``embed``: each prompt's pooled, normalised last hidden state
        (``pooling.py``; ``PoolingParams`` picks LAST or MEAN and normalisation)."""
        self._check_open()
        return embed(self._pooling_engine(), prompts, pooling_params)

    def encode(
        self, prompts: object, pooling_params: object = None, *, use_tqdm: bool = False
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``encode``: ``embed``'s vectors as tensors."""
        self._check_open()
        return encode(self._pooling_engine(), prompts, pooling_params)

    def score(
        self, data_1: object, data_2: object, /, *, pooling_params: object = None
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``score`` for an embedding model: the cosine similarity of each pair's
        embeddings (``score.py``: one prompt or a list on each side, 1:1, 1:N or N:N)."""
        self._check_open()
        return score(self._pooling_engine(), data_1, data_2, pooling_params)

    def _pooling_engine(self) -> LLMEngine:
        if self.model_runner is None:
            raise NotImplementedError(
                "embed/encode run in this process's engine: not with "
                f"{MULTIPROCESSING_ENV}=1 (the engine core is in another process)"
            )
        return self.llm_engine

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block; False (changing nothing) while requests run."""
        return self.llm_engine.reset_prefix_cache()

    @property
    def last_run_stats(self) -> RunStats | None:
        """The last ``generate``'s counters: ``print(llm.last_run_stats)`` for a summary."""
        return self.llm_engine.last_run_stats
