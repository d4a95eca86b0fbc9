"""A tiny random checkpoint (Qwen3 by default; any family of ``models/registry.py``) with a
locally trained tokenizer, for tests and demos.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a built-in corpus,
and the weights are random. transformers' default init (N(0, 0.02)) makes a random model
repeat one token forever, which would let an engine that ignores its inputs pass greedy
comparisons; the weights are therefore drawn larger (see ``_randomize``) so that greedy
continuations vary with the prompt and along the sequence, and top-2 logit margins are
rarely so small that float noise could flip an argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|bos|>", "<|pad|>")
"""eos, bos, pad (eos first, so it is id 0)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|bos|>{{ message['role'] }}\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
"""ChatML's shape over the tokenizer's own special tokens: each turn opens with ``<|bos|>``
and its role and closes with the eos, so an answer ends where the model emits eos. Why
these tokens: new ones would change the vocabulary, and with it every weight drawn."""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. It was the best of times, it was the worst of times, it was the age of wisdom,
it was the age of foolishness. Call me Ishmael. Some years ago, never mind how long
precisely, having little or no money in my purse, I thought I would sail about a little.
In the beginning the universe was created. This has made a lot of people very angry and
been widely regarded as a bad move. All happy families are alike; each unhappy family is
unhappy in its own way. The sky above the port was the color of television, tuned to a dead
channel. Once upon a time there was a little girl who lived in a village near the forest.
Whenever she went out, the little girl wore a red riding cloak, so everyone in the village
called her Little Red Riding Hood. One morning, her mother said: take this basket of bread
and butter to your grandmother, who is ill. Walk straight there and do not talk to strangers.
The weather today is sunny with a light breeze from the west. Tomorrow we expect clouds in
the morning and rain in the afternoon, with temperatures between twelve and eighteen degrees.
Please remember to bring an umbrella if you are going out in the evening.
To make a cup of tea, boil fresh water, warm the pot, add one spoon of leaves for each person
and one for the pot, pour the water, wait four minutes, then pour through a strainer. Milk
and sugar are optional. Some people prefer lemon, honey, or nothing at all.
Computers store numbers in binary. A byte holds eight bits, and a kilobyte holds one thousand
and twenty four bytes. Memory is divided into pages, and the operating system maps virtual
pages to physical frames. A cache keeps recently used data close to the processor so that
the next access is fast. When the cache is full, the least recently used entry is evicted.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))
The train leaves the station at seven fifteen and arrives in the city at nine o'clock. Tickets
can be bought online or at the counter; children under twelve travel for half the price.
Dear team, thank you for your hard work this quarter. Our sales grew by twenty percent, and
the new product was well received by customers in every region. Let us keep the momentum.
Mathematics is the language of nature. The area of a circle is pi times the radius squared,
and the sum of the angles of a triangle is one hundred and eighty degrees. Prime numbers such
as two, three, five, seven, eleven and thirteen have no divisors other than one and themselves.
She opened the window and listened to the birds singing in the garden. The roses were in
bloom, the grass was wet with dew, and somewhere far away a dog was barking at the postman.
Why did the chicken cross the road? To get to the other side. Knock knock. Who is there?
Question: what is the capital of France? Answer: Paris. Question: how many legs does a spider
have? Answer: eight. Question: what color is the sky on a clear day? Answer: blue.
History teaches us that empires rise and fall. The Roman Empire lasted for centuries, built
roads and aqueducts, and left a legacy of law, language and architecture across Europe.
Music can change the way we feel. A slow song in a minor key sounds sad, while a fast rhythm
in a major key makes people want to dance. Learning an instrument takes patience and practice.
The recipe calls for two cups of flour, one cup of sugar, three eggs, a pinch of salt and a
teaspoon of vanilla. Mix the dry ingredients, beat in the eggs, and bake for thirty minutes.
Hello, world! How are you doing today? I am fine, thanks. What are your plans for the weekend?
We might go hiking in the mountains, or visit the museum downtown if it rains.
"""


def train_tokenizer(vocab_size: int = 768) -> Any:
    """Byte-level BPE trained on ``CORPUS``, wrapped as a ``PreTrainedTokenizerFast``.

    Byte-level, so any text round-trips even where the small vocabulary has no merge for it.
    Deterministic: BPE training on a fixed corpus has no randomness. It carries
    ``CHAT_TEMPLATE``, so ``LLM.chat`` runs on the tiny model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    eos, bos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=pad
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


LINEAR_GAIN = 2.0
"""Linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2): 0.25 at fan-in 64."""
EMBED_STD = 0.3
"""Embedding (and untied head) std. Larger makes a tied model echo its last token."""
NORM_RANGE = (0.5, 1.5)
"""RMSNorm weights ~ U(NORM_RANGE): not all ones, so a norm that drops its weight shows."""


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter from a private generator, in ``named_parameters`` order.

    Scales were picked empirically (see the module docstring): with 2 layers at hidden 64,
    greedy 32-token continuations of 10 prompts have ~9-27 distinct tokens each, all differ,
    and the top-2 logit margin is below 1e-2 in under 1% of steps.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                lo, hi = NORM_RANGE
                value = torch.rand(param.shape, generator=gen) * (hi - lo) + lo
            elif "embed_tokens" in name or "lm_head" in name:
                value = torch.randn(param.shape, generator=gen) * EMBED_STD
            else:
                std = LINEAR_GAIN / math.sqrt(param.shape[1])
                value = torch.randn(param.shape, generator=gen) * std
            param.copy_(value)


def _max_shard_size(state_dict: dict[str, torch.Tensor], num_shards: int) -> int:
    """The smallest ``max_shard_size`` for which transformers writes ``num_shards`` files.

    Uses the same splitter ``save_pretrained`` calls, so the search needs no disk writes.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    def count(size: int) -> int:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=size)
        return len(split.filename_to_tensors)

    lo, hi = 1, sum(t.numel() * t.element_size() for t in state_dict.values())
    while lo < hi:  # count() does not increase with the size
        mid = (lo + hi) // 2
        if count(mid) <= num_shards:
            hi = mid
        else:
            lo = mid + 1
    if count(lo) != num_shards:
        raise ValueError(f"cannot split this model into exactly {num_shards} shards")
    return lo


def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 768,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    num_shards: int = 1,
    rope_parameters: dict[str, Any] | None = None,
    architecture: str = "Qwen3ForCausalLM",
    config_overrides: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a random float32 model of ``architecture`` (transformers' class of that name)
    and its tokenizer to ``out_dir``; ``config_overrides`` sets further config keys
    (``attention_bias``, ``mlp_bias``, ``rms_norm_eps``, ...).

    ``vocab_size`` is the BPE training target; the model's vocabulary is the trained
    tokenizer's actual size (``len(tokenizer)``), and ``eos_token_id`` its eos id.
    ``num_shards > 1`` writes that many safetensors files plus their index. Deterministic
    for a given seed (the caller's global RNG state is left untouched). ``progress`` is
    called with a line before each stage (the CLI prints them: the stages take seconds).
    Returns the path.
    """
    say = progress or (lambda line: None)
    import transformers

    model_cls = getattr(transformers, architecture)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"training the tokenizer (byte-level BPE, vocabulary {vocab_size})")
    tokenizer = train_tokenizer(vocab_size)
    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    config = model_cls.config_class(**(settings | (config_overrides or {})))
    say(f"building a random {architecture} ({num_layers} layers, hidden size {hidden_size})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # transformers' own init draws from the global RNG
        model = model_cls(config).float().eval()
    _randomize(model, seed)
    shard_size = _max_shard_size(model.state_dict(), num_shards) if num_shards > 1 else "50GB"
    say(f"writing the weights and the tokenizer to {out}")
    model.save_pretrained(out, max_shard_size=shard_size)
    written = sorted(out.glob("*.safetensors"))
    if len(written) != num_shards:
        raise RuntimeError(f"wanted {num_shards} safetensors files, wrote {len(written)}")
    tokenizer.save_pretrained(out)
    return out
