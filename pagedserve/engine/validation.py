"""Checks every engine core applies to a tokenized request before queueing it (ValueError on failure)."""

from __future__ import annotations

from pagedserve.engine.messages import EngineCoreRequest


def check_request(request: EngineCoreRequest, *, max_model_len: int, vocab_size: int, max_logprobs: int) -> None:
    """Raise ValueError for a request the model cannot run: empty, too long, unknown token ids, too many logprobs."""
    ids = request.prompt_token_ids
    if not ids:
        raise ValueError("The prompt is empty: at least one token is required.")
    if len(ids) >= max_model_len:
        raise ValueError(f"Input length ({len(ids)}) exceeds model's maximum context length ({max_model_len}).")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"Token id {bad[0]!r} is out of vocabulary (vocab size {vocab_size}).")
    params = request.sampling_params
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(f"Requested {name} of {value}, which is greater than max allowed: {max_logprobs}")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids {bad_stop} are out of vocabulary (vocab size {vocab_size}).")
