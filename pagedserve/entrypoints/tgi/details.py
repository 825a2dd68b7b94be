"""TGI's response bodies: ``generated_text`` and ``details`` (tokens, prefill, top tokens, best_of
sequences), and the per-token events of /generate_stream."""

from __future__ import annotations

import json

from pagedserve.entrypoints.serving.logprobs import TokenTexts, clamp_logprob
from pagedserve.entrypoints.tgi.protocol import GenerateParameters, GenerateRequest
from pagedserve.entrypoints.tgi.validation import Plan
from pagedserve.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob


class TGIDetails:
    """Formats outputs in TGI's shapes, with each token's text and special flag."""

    __slots__ = ("texts",)

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts

    def generate_body(self, request: GenerateRequest, plan: Plan, result: RequestOutput) -> dict:
        p = request.parameters
        outputs = sorted(result.outputs, key=lambda c: c.index)
        if plan.best_of > 1:
            outputs.sort(key=lambda c: -sum(lp.logprob for lp in (c.logprobs or [])))
        best = outputs[0]
        prefix = request.inputs if p.return_full_text else ""
        body: dict = {"generated_text": prefix + best.text}
        if p.details or p.decoder_input_details:
            details = self._sequence_details(best, plan, result, p)
            if plan.best_of > 1:
                details["best_of_sequences"] = [
                    {"generated_text": prefix + other.text, **self._sequence_details(other, plan, result, p)}
                    for other in outputs[1:]
                ]
            body["details"] = details
        return body

    def _sequence_details(
        self, completion: CompletionOutput, plan: Plan, result: RequestOutput, p: GenerateParameters
    ) -> dict:
        logprobs = completion.logprobs or []
        tokens = [
            self._token_json(t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(completion.token_ids)
        ]
        details: dict = {
            "finish_reason": tgi_finish_reason(completion),
            "generated_tokens": len(completion.token_ids),
            "seed": plan.seed,
            "prefill": self._prefill(plan.token_ids, result.prompt_logprobs) if p.decoder_input_details else [],
            "tokens": tokens,
        }
        if p.top_n_tokens:
            details["top_tokens"] = [self._top_tokens(lp, p.top_n_tokens) for lp in logprobs]
        return details

    def _prefill(self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> list[dict]:
        logprobs = logprobs or []
        return [
            {
                "id": t,
                "text": self.texts.text(t),
                "logprob": clamp_logprob(logprobs[i].logprob) if i < len(logprobs) and logprobs[i] else None,
            }
            for i, t in enumerate(token_ids)
        ]

    def _token_json(self, token_id: int, logprob: TokenLogprob | None, text: str | None = None) -> dict:
        return {
            "id": token_id,
            "text": self.texts.text(token_id) if text is None else text,
            "logprob": clamp_logprob(logprob.logprob) if logprob is not None else None,
            "special": self.texts.is_special(token_id),
        }

    def _top_tokens(self, logprob: TokenLogprob | None, count: int) -> list[dict]:
        if logprob is None:
            return []
        texts = self.texts
        return [
            {"id": t, "text": texts.text(t), "logprob": clamp_logprob(lp), "special": texts.is_special(t)}
            for t, lp in logprob.top[:count]
        ]

    def token_events(
        self,
        completion: CompletionOutput,
        p: GenerateParameters,
        index: int,
        finished: bool,
        generated_text: str,
        input_length: int,
        seed: int | None,
        prefix: str,
    ) -> list[str]:
        """One event per token; the delta text goes on the last non-special token of the delta."""
        texts = self.texts
        ids = completion.token_ids
        logprobs = completion.logprobs or []
        last_plain = max((i for i, t in enumerate(ids) if not texts.is_special(t)), default=-1)
        if last_plain == -1 and completion.text:
            last_plain = len(ids) - 1  # held-back text released by a special token (e.g. EOS)
        events = []
        for i, token_id in enumerate(ids):
            if i == last_plain:
                text = completion.text
            else:
                text = texts.text(token_id) if texts.is_special(token_id) else ""
            logprob = logprobs[i] if i < len(logprobs) else None
            event: dict = {
                "index": index + i,
                "token": self._token_json(token_id, logprob, text),
                "top_tokens": self._top_tokens(logprob, p.top_n_tokens) if p.top_n_tokens else None,
                "generated_text": None,
                "details": None,
            }
            if finished and i == len(ids) - 1:
                event["generated_text"] = prefix + generated_text
                event["details"] = {
                    "finish_reason": tgi_finish_reason(completion),
                    "generated_tokens": index + len(ids),
                    "seed": seed,
                    "input_length": input_length,
                }
            events.append(tgi_event(event))
        return events


def tgi_finish_reason(completion: CompletionOutput) -> str:
    if completion.finish_reason is FinishReason.LENGTH:
        return "length"
    if isinstance(completion.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def tgi_event(data: dict) -> str:
    return "data:" + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"
