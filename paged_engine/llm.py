"""``LLM``: the user-facing entry point, ``LLM(model_dir, **config).generate(prompts)``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import (
    LLMEngine,
    ParamsLike,
    Prompt,
    RequestOutput,
    RunStats,
    Tokenizer,
)
from paged_engine.utils.loader import load_tokenizer
from paged_engine.utils.model_config import eos_token_ids, load_config
from paged_engine.worker.model_runner import ModelRunner


class LLM:
    """A Qwen3 model from a Hugging Face-format directory, served through the paged engine.

    ``config`` takes the fields of ``EngineConfig`` (an unknown name is a TypeError naming
    it). Construction validates everything (device, config.json, attention backend, pool
    size, checkpoint) before a weight is read or the model or the KV pool is allocated;
    only a pool sized from CUDA memory (no ``num_kvcache_blocks``) is checked after the
    weights load, as its budget is measured with the loaded model.

    ``max_model_len`` may not exceed the model's ``max_position_embeddings`` (ValueError
    naming both); when not given it is ``EngineConfig``'s default capped at that.
    ``self.config`` holds the values the engine runs with. Generation stops at every eos
    id: generation_config.json's (as transformers' ``generate``), else config.json's,
    else the tokenizer's.
    """

    def __init__(self, model_dir: str | Path, **config: Any) -> None:
        engine_config = EngineConfig(**config)
        hf_config = load_config(model_dir)
        if "max_model_len" not in config:
            max_pos = int(hf_config.max_position_embeddings)
            default = min(engine_config.max_model_len, max_pos)
            engine_config = replace(engine_config, max_model_len=default)
        # the tokenizer and eos ids can be refused too: read before the weights
        self.tokenizer = load_tokenizer(model_dir)
        eos = eos_token_ids(model_dir, hf_config)
        if eos is None and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (int(self.tokenizer.eos_token_id),)
        self.model_runner = ModelRunner(model_dir, engine_config)
        self.config = self.model_runner.config
        self.engine = LLMEngine(
            self.model_runner,
            self.config,
            vocab_size=int(self.model_runner.hf_config.vocab_size),
            num_kvcache_blocks=self.model_runner.num_kvcache_blocks,
            eos_token_id=eos,
            tokenizer=cast(Tokenizer | None, self.tokenizer),
        )

    def generate(
        self,
        prompts: SequenceABC[Prompt],
        params: ParamsLike | SequenceABC[ParamsLike] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in input order; ``text`` is set when the model has a tokenizer."""
        return self.engine.generate(prompts, params, use_tqdm=use_tqdm)

    @property
    def last_run_stats(self) -> RunStats | None:
        return self.engine.last_run_stats
