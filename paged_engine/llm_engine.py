"""``LLMEngine`` as vLLM exposes it (``from paged_engine import LLMEngine``): the engine of
``engine/llm_engine.py`` over a real model, built from ``EngineArgs``.

``from_engine_args`` is the one path from arguments to a running engine: ``LLM(...)``
builds its ``llm_engine`` through it too, so an engine built either way is the same
(model, tokenizer, eos ids, KV pool, tensor-parallel workers). Why a subclass here and
not a method of the torch-free engine: building needs the model runner (torch), and
``engine/`` never imports upwards (tests/test_layout.py); the engine it builds is the
torch-free one, with the model's records and the workers' lifetime added.

vLLM's loop runs unchanged::

    engine = LLMEngine.from_engine_args(EngineArgs(model="path/to/model-dir"))
    engine.add_request("0", "The KV cache is", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from paged_engine.config import EngineConfig
from paged_engine.engine.inputs import Tokenizer
from paged_engine.engine.llm_engine import LLMEngine as CoreEngine
from paged_engine.engine_args import EngineArgs
from paged_engine.errors import InvalidRequestError, ModelConfigError
from paged_engine.sampling_params import SamplingParams
from paged_engine.utils.model_config import ModelConfig
from paged_engine.utils.tokenizer import load_tokenizer
from paged_engine.worker.model_runner import ModelRunner

__all__ = ["LLMEngine", "ModelFiles", "model_dir_of", "read_model", "refuse_lora"]


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


def refuse_lora(lora_request: object) -> None:
    """vLLM's ``lora_request``: only None (no adapter) means anything here."""
    if lora_request is not None:
        raise InvalidRequestError(
            "lora_request", "lora_request: LoRA adapters are not supported here; pass None"
        )


@dataclass(slots=True)
class ModelFiles:
    """What building an engine reads before any weight: the config with the model's
    ``max_model_len`` default applied, config.json's record, the tokenizer and the eos
    ids. One record for both engines (this one and ``mp_engine``'s, whose process loads
    no weights), so both refuse the same arguments and directories the same way."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    """The transformers tokenizer, None for a directory without one."""
    eos_token_ids: tuple[int, ...] | None


def read_model(engine_args: EngineArgs) -> ModelFiles:
    """Validate ``engine_args`` and read the model directory (a .gguf file converted
    once): config.json and generation_config.json, the tokenizer, the eos ids (the
    tokenizer's when neither config sets one, checked against the vocabulary)."""
    config = engine_args.create_engine_config()
    engine_args.check_load_format()
    tokenizer_arg = engine_args.tokenizer
    model_dir = model_dir_of(engine_args.model)
    tokenizer_dir = model_dir if tokenizer_arg is None else model_dir_of(tokenizer_arg)
    # config.json and generation_config.json, read once: the runner and every
    # tensor-parallel worker get this record, never the file
    model_config = ModelConfig.load(model_dir)
    if engine_args.max_model_len is None:
        default = min(config.max_model_len, model_config.max_position_embeddings)
        config = replace(config, max_model_len=default)
    tokenizer = load_tokenizer(
        tokenizer_dir, model_config.hf_config if tokenizer_arg is None else None
    )
    eos = model_config.eos_token_ids
    if eos is None and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
        _check_tokenizer_eos(eos[0], model_config.vocab_size, tokenizer_dir)
    return ModelFiles(config, model_config, tokenizer, eos)


class LLMEngine(CoreEngine):
    """The engine over a real model (see the module docstring); build it with
    ``from_engine_args``. ``close()`` ends its tensor-parallel workers (also done when it
    is garbage collected or the interpreter exits)."""

    model_runner: ModelRunner
    """The worker's runner (the base class knows only its ``run``)."""
    model_config: ModelConfig
    """config.json and generation_config.json, as read once for this engine."""
    hf_tokenizer: Any
    """The transformers tokenizer (None for a directory without one)."""
    _finalizer: Callable[[], Any] | None = None

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, *, enable_multiprocessing: bool = False
    ) -> LLMEngine:
        """Validate ``engine_args``, read the model directory (config.json, the
        tokenizer and the eos ids are refused before any weight is read), load the model
        (with ``tensor_parallel_size - 1`` workers) and its KV pool, and return the
        engine. ``max_model_len`` when None is 4096 capped at the model's
        ``max_position_embeddings``. Generation stops at every eos id:
        generation_config.json's, else config.json's, else the tokenizer's.

        ``enable_multiprocessing`` (vLLM's keyword) must be False: this engine is driven
        step by step in this process (``add_request``, ``step``), which a core in another
        process does not offer. ``LLM`` runs its core in a process of its own with
        ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (``mp_engine.py``); the variable is read by
        ``LLM`` alone, never here."""
        if enable_multiprocessing is not False:
            raise NotImplementedError(
                f"enable_multiprocessing={enable_multiprocessing!r}: LLMEngine runs in this "
                "process; for an engine core in a process of its own use LLM(...) with "
                "VLLM_ENABLE_V1_MULTIPROCESSING=1"
            )
        files = read_model(engine_args)
        config, model_config, tokenizer = files.config, files.model_config, files.tokenizer
        eos = files.eos_token_ids
        if config.tensor_parallel_size == 1:
            runner = ModelRunner(model_config, config, eos_token_ids=eos or ())
        elif config.distributed_executor_backend == "ray":
            from paged_engine.worker.ray_executor import start_ray_tensor_parallel

            runner = start_ray_tensor_parallel(model_config, config, eos_token_ids=eos or ())
        else:
            from paged_engine.worker.tp_worker import start_tensor_parallel

            runner = start_tensor_parallel(model_config, config, eos_token_ids=eos or ())
        runner.grammars.tokenizer = tokenizer  # structured outputs: the engine's tokenizer
        workers = runner.workers
        try:
            engine = cls(
                runner,
                runner.config,  # the device's defaults filled in by the runner
                vocab_size=model_config.vocab_size,
                num_kvcache_blocks=runner.num_kvcache_blocks,
                eos_token_id=eos,
                tokenizer=cast(Tokenizer | None, tokenizer),
            )
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        engine.model_config = model_config
        engine.hf_tokenizer = tokenizer
        engine._finalizer = weakref.finalize(engine, workers.close) if workers else None
        return engine

    def close(self) -> None:
        """End the tensor-parallel workers, if any (idempotent); a later step raises."""
        if self._finalizer is not None:
            self._finalizer()

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer (vLLM's name)."""
        return getattr(self, "hf_tokenizer", self.tokenizer)

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def add_request(
        self,
        request_id: str,
        prompt: object,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        arrival_time: float | None = None,
        lora_request: object = None,
    ) -> None:
        """vLLM's signature: ``lora_request`` must be None (refused naming it, before
        anything changes); see ``engine.llm_engine.LLMEngine.add_request``."""
        refuse_lora(lora_request)
        super().add_request(request_id, prompt, params, arrival_time=arrival_time)
