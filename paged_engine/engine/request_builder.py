"""From ``add_request``'s or ``generate``'s arguments to the engine's ``Request`` record.

Admission parses and checks everything first (``inputs.py``), so a refused request leaves
the engine exactly as it was; only then are the request's ``n`` sequences and their
completion records built, each with what its text needs (an ``IncrementalDetokenizer``
when it is produced step by step). Nothing here touches the engine's queues:
``LLMEngine`` queues the record it gets back.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from paged_engine.config import EngineConfig
from paged_engine.engine.detokenizer import make_detokenizer, stream_backend
from paged_engine.engine.inputs import Tokenizer, check_request, parse_params, parse_prompt
from paged_engine.engine.request import Completion, Request
from paged_engine.engine.sequence import Sequence


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a seeded request: ``seed`` itself for the first
    (so ``n=1`` samples as before), a distinct odd-multiplier mix for the others."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % 2**64


class RequestBuilder:
    """Builds requests for one engine: its config, KV pool, vocabulary and tokenizer."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        tokenizer: Tokenizer | None,
    ) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._text_backend = stream_backend(tokenizer)
        """What streamed text is decoded through in Rust, or None (``detokenizer.py``)."""
        self._salts = itertools.count()
        """The private salts of prompt-logprobs requests."""

    def build(
        self, request_id: str, prompt: object, params: object, where: str, *, stream: bool
    ) -> Request:
        """The record of a request, refused (``InvalidRequestError``, naming ``where``)
        before anything is built. ``stream``: its text is wanted step by step."""
        parsed = parse_prompt(prompt, self.tokenizer, self.vocab_size, where)
        sp = parse_params(params, where)
        has_tok = self.tokenizer is not None
        sp = check_request(
            parsed.token_ids,
            sp,
            self.config,
            self.num_blocks,
            where,
            has_tokenizer=has_tok,
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
        )
        bs = self.config.kvcache_block_size
        salt = parsed.cache_salt
        if sp.prompt_logprobs is not None:
            # Prompt logprobs need every prompt row computed: a salt no other request has
            # makes the prefix cache miss (R4s), without a rule of its own. Completion 0
            # alone computes the rows (vLLM returns them once per request); the others
            # share its salt, so they hit its blocks, and their params do not ask.
            # A counter, not an address: an id reused after its request finished would
            # otherwise hit the earlier request's blocks (CPython reuses ids).
            salt = f"{salt or ''}\x00prompt_logprobs\x00{request_id}\x00{next(self._salts)}"
        incremental = has_tok and sp.detokenize and (stream or bool(sp.stop))
        completions = []
        for i in range(sp.n):
            child = sp if sp.seed is None or i == 0 else replace(sp, seed=child_seed(sp.seed, i))
            if i and sp.prompt_logprobs is not None:
                child = replace(child, prompt_logprobs=None)
            # parse_prompt checked the tokens, the config the block size (see the method).
            seq = Sequence.from_checked_tokens(
                list(parsed.token_ids), child, block_size=bs, cache_salt=salt
            )
            skip = sp.skip_special_tokens
            detok = make_detokenizer(self._text_backend, skip) if incremental else None
            completions.append(Completion(i, seq, detok))
        request = Request(request_id, parsed.text, parsed.token_ids, sp, completions)
        if sp.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(parsed.token_ids)
            request.decoded_prompt_logprobs = [None] * len(parsed.token_ids)
        return request
