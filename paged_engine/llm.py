"""``LLM``: the user-facing entry point, ``LLM(model_dir, **config).generate(prompts)``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
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
from paged_engine.worker.model_runner import ModelRunner


class LLM:
    """A Qwen3 model from a Hugging Face-format directory, served through the paged engine.

    ``config`` takes the fields of ``EngineConfig`` (an unknown name is a TypeError naming
    it). Construction validates everything (device, attention backend, checkpoint, pool
    size) before the model or the KV pool is allocated.
    """

    def __init__(self, model_dir: str | Path, **config: Any) -> None:
        self.config = EngineConfig(**config)
        self.model_runner = ModelRunner(model_dir, self.config)
        self.tokenizer = load_tokenizer(model_dir)
        hf = self.model_runner.hf_config
        eos = getattr(hf, "eos_token_id", None)
        if isinstance(eos, list):  # some configs list several; the first is the primary one
            eos = eos[0] if eos else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        self.engine = LLMEngine(
            self.model_runner,
            self.model_runner.config,
            vocab_size=int(hf.vocab_size),
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
