"""``LLM``: the user-facing entry point, shaped like vLLM's offline API.

``LLM(model).generate(prompts, sampling_params)`` and ``LLM.chat(messages)``, with vLLM's
argument names, so that porting a script is a matter of changing the import.

With ``tensor_parallel_size=N`` the model is sharded over ``N`` ranks: this process and
``N - 1`` spawned workers (``worker/tp_worker.py``). ``close()``, a ``with`` block, garbage
collection or interpreter exit ends them.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from paged_engine.config import EngineConfig
from paged_engine.engine.inputs import Tokenizer
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request import RequestOutput
from paged_engine.engine.stats import RunStats
from paged_engine.errors import ModelConfigError
from paged_engine.utils.model_config import ModelConfig
from paged_engine.utils.tokenizer import load_tokenizer
from paged_engine.worker.model_runner import ModelRunner

_ALIASES = {"block_size": "kvcache_block_size"}
"""vLLM's names for our fields."""

_NOT_HERE = {
    "pipeline_parallel_size": "pipeline parallelism is not supported: use 1",
}


def model_dir_of(model: object) -> Path:
    """The Hugging Face directory to load: ``model`` itself, or, for a .gguf file (or a
    directory holding one and no config.json), its conversion, made once and cached
    (``utils/gguf_convert.py``)."""
    if not isinstance(model, str | Path):
        raise TypeError(f"model must be a path to a model directory or .gguf file, got {model!r}")
    path = Path(model)
    if not path.exists() and path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if not path.exists() and not re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.exists():  # a hub id, such as "Qwen/Qwen3-0.6B"
        raise FileNotFoundError(
            f"model {str(model)!r} is not a local directory: paged_engine loads only local "
            "Hugging Face directories and .gguf files, and never downloads. On a machine with "
            f"network, fetch one with `hf download {model} --local-dir DIR`, then pass DIR"
        )
    from paged_engine.utils.gguf_convert import resolve_model_path

    return resolve_model_path(path)


def _engine_config(kwargs: dict[str, Any]) -> tuple[EngineConfig, bool]:
    """An ``EngineConfig`` from ``LLM``'s keywords (vLLM's names accepted), and whether
    ``max_model_len`` was given."""
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in _NOT_HERE:
            if value not in (None, 1):
                raise ValueError(f"{key}={value!r}: {_NOT_HERE[key]}")
            continue
        name = _ALIASES.get(key, key)
        if name in values:
            alias = next(a for a, n in _ALIASES.items() if n == name)
            raise TypeError(f"both {alias!r} and {name!r} given")
        values[name] = value
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(
            f"unknown LLM argument(s) {unknown}; known: {sorted(known | set(_ALIASES))}"
        )
    return EngineConfig(**values), "max_model_len" in values


def _check_tokenizer_eos(eos: int, vocab_size: int, tokenizer_dir: Path) -> None:
    """The tokenizer's eos (the fallback when neither config sets one) is a token of the
    model's vocabulary: one outside could never be generated, and masking it (min_tokens)
    would index past the logits."""
    if eos >= vocab_size:
        raise ModelConfigError(
            str(tokenizer_dir / "tokenizer_config.json"),
            f"the tokenizer's eos_token has id {eos}, outside the model's vocabulary "
            f"(vocab_size {vocab_size})",
            key="eos_token",
        )


class LLM:
    """A Qwen3 model from a local Hugging Face-format directory, served by the paged engine.

    ``model`` is the directory (a hub name is refused with a message saying how to fetch
    it); ``tokenizer`` another directory holding the tokenizer (default: ``model``). The
    keywords are ``EngineConfig``'s fields, with vLLM's names where they differ
    (``block_size`` for ``kvcache_block_size``); an unknown one is a TypeError naming it.

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
    """

    def __init__(
        self, model: str | Path, *, tokenizer: str | Path | None = None, **kwargs: Any
    ) -> None:
        engine_config, len_given = _engine_config(kwargs)
        model_dir = model_dir_of(model)
        tokenizer_dir = model_dir if tokenizer is None else model_dir_of(tokenizer)
        # config.json and generation_config.json, read once: the runner and every
        # tensor-parallel worker get this record, never the file
        model_config = ModelConfig.load(model_dir)
        if not len_given:
            default = min(engine_config.max_model_len, model_config.max_position_embeddings)
            engine_config = replace(engine_config, max_model_len=default)
        # the tokenizer and eos ids can be refused too: read before the weights
        self.tokenizer = load_tokenizer(
            tokenizer_dir, model_config.hf_config if tokenizer is None else None
        )
        eos = model_config.eos_token_ids
        if eos is None and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (int(self.tokenizer.eos_token_id),)
            _check_tokenizer_eos(eos[0], model_config.vocab_size, tokenizer_dir)
        self._closed = False
        if engine_config.tensor_parallel_size == 1:
            self.model_runner = ModelRunner(model_config, engine_config, eos_token_ids=eos or ())
        else:
            from paged_engine.worker.tp_worker import start_tensor_parallel

            self.model_runner = start_tensor_parallel(
                model_config, engine_config, eos_token_ids=eos or ()
            )
        workers = self.model_runner.workers
        self._finalizer = weakref.finalize(self, workers.close) if workers else None
        self.config = self.model_runner.config
        """The engine config with the device's defaults filled in (by the runner)."""
        try:
            self.llm_engine = LLMEngine(
                self.model_runner,
                self.config,
                vocab_size=model_config.vocab_size,
                num_kvcache_blocks=self.model_runner.num_kvcache_blocks,
                eos_token_id=eos,
                tokenizer=cast(Tokenizer | None, self.tokenizer),
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the tensor-parallel workers (if any); afterwards ``generate`` and ``chat``
        raise. Idempotent."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

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

    def generate(
        self,
        prompts: object,
        sampling_params: object = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete one prompt or a list (text, token ids, ``{"prompt": ...}`` or
        ``{"prompt_token_ids": ...}``, optionally with ``"cache_salt"``) with one
        ``SamplingParams`` or a list of them (default: ``SamplingParams()``). Outputs in
        input order. Every request is validated before any runs; see
        ``LLMEngine.generate`` for what happens when a step fails."""
        self._check_open()
        return self.llm_engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: object,
        sampling_params: object = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Complete one conversation (a list of ``{"role", "content"}`` messages) or a list
        of them, rendered with the tokenizer's chat template (or ``chat_template``)."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat() needs a tokenizer; this model directory has none")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template: pass chat_template=, or use generate()"
            )
        if not isinstance(messages, list | tuple) or not messages:
            raise TypeError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list | tuple) or not all(isinstance(m, Mapping) for m in conv):
                raise TypeError(f"conversation {i} must be a list of message dicts")
            rendered = tok.apply_chat_template(
                list(conv),
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block; False (changing nothing) while requests run."""
        return self.llm_engine.reset_prefix_cache()

    @property
    def last_run_stats(self) -> RunStats | None:
        """The last ``generate``'s counters: ``print(llm.last_run_stats)`` for a summary."""
        return self.llm_engine.last_run_stats


__all__ = ["LLM"]
