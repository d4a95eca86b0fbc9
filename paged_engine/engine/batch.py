"""``generate``'s batch: the prompts paired with their sampling params (refused as a whole
before anything is queued), and the outputs a failed run hands back on its exception."""

from __future__ import annotations

from paged_engine.engine.inputs import is_single_prompt
from paged_engine.engine.request import RequestOutput
from paged_engine.sampling_params import SamplingParams


def pair_prompts(prompts: object, params: object) -> list[tuple[object, object]]:
    """``prompts`` (one prompt or a list) each with its params: ``params`` is one
    ``SamplingParams`` (or dict, or None) for all, or a list with one per prompt. Raises
    TypeError or ValueError naming what is wrong; the pieces are checked later, each."""
    batch = [prompts] if is_single_prompt(prompts) else prompts
    if not isinstance(batch, list | tuple):
        raise TypeError(
            "prompts must be a prompt (a string, token ids or a prompt dict) or a list "
            f"of them, got {type(prompts).__name__}"
        )
    if not batch:
        raise ValueError("prompts is empty")
    if params is None or isinstance(params, SamplingParams | dict):
        per_prompt: list[object] = [params] * len(batch)
    elif isinstance(params, list | tuple):
        per_prompt = list(params)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} sampling params for {len(batch)} prompts")
    else:
        raise TypeError(
            f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    return list(zip(batch, per_prompt, strict=True))


def attach_partial_outputs(exc: BaseException, outputs: list[RequestOutput]) -> None:
    """``exc.partial_outputs = outputs``, with a note saying so (where the type allows)."""
    try:
        exc.partial_outputs = outputs  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type with __slots__: nothing to do
        return
    if outputs and hasattr(exc, "add_note"):
        exc.add_note(f"generate: {len(outputs)} request(s) had finished: see .partial_outputs")
