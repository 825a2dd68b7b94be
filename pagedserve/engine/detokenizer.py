"""Incremental detokenization of one sample: token ids in, safe-to-send text deltas out.

Owns the two hold-backs of streaming text: an incomplete UTF-8 tail (a trailing "\\ufffd") and
the last ``max(len(stop)) - 1`` characters that could still begin a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first generated token, so a tokenizer that
# encodes leading spaces in the token (SentencePiece "▁word") decodes them correctly.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def make_decode_fn(tokenizer: object, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """The cheapest correct ``ids -> str`` for a Hugging Face tokenizer.

    A fast tokenizer without clean-up of tokenization spaces decodes straight through its Rust
    backend, skipping the Python wrapper of ``tokenizer.decode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        backend_decode = backend.decode

        def decode_fast(ids: Sequence[int]) -> str:
            return backend_decode(list(ids), skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode_slow(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)  # type: ignore[attr-defined]

    return decode_slow


class IncrementalDetokenizer:
    """Turns one sample's token ids into text, a delta at a time.

    Invariants: ``output_text`` is the text of every decoded output token (truncated at a matched
    stop string); text returned by ``get_next_output_text(delta=True)`` is never taken back; while
    unfinished the last ``stop_buffer_length`` characters are held back.

    Decoding uses TGI's prefix/read offsets: the text of ``ids[prefix_offset:]`` minus the text of
    ``ids[prefix_offset:read_offset]`` is the new text, sent only when it does not end in an
    incomplete UTF-8 sequence (which decodes to "\\ufffd").
    """

    def __init__(self, tokenizer: object, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._decode = make_decode_fn(tokenizer, params.skip_special_tokens)
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset], cached
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0
        self._sent_chars = 0
        self._stopped = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Decode new tokens; return the stop string if one matched (the text is then truncated).

        ``stop_terminated``: the last token ended the sample as EOS or a stop token id; its text
        is left out unless ``include_stop_str_in_output``.
        """
        if self._stopped:
            return None
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            to_decode = new_token_ids[:-1]
        old_len = len(self.output_text)
        pieces = [self._decode_next(t) for t in to_decode]
        self.num_output_tokens += len(new_token_ids)
        if pieces:
            self.output_text += "".join(pieces)
        return self._check_stop(old_len)

    def finish(self) -> str | None:
        """The sample ended (length, EOS, stop id): decode what is held back as incomplete UTF-8.

        A trailing incomplete character is dropped (as TGI and vLLM do). Returns a stop string if
        the flushed text completed one.
        """
        if self._stopped or self._read_offset >= len(self._ids):
            return None
        old_len = len(self.output_text)
        new_text = self._decode(self._ids[self._prefix_offset :])
        tail = new_text[len(self._get_prefix_text()) :].rstrip(_REPLACEMENT)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        self.output_text += tail
        return self._check_stop(old_len)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text that is safe to send: all of it when finished, else minus the stop hold-back."""
        end = len(self.output_text) if finished else len(self.output_text) - self.stop_buffer_length
        if not delta:
            return self.output_text[: max(end, 0)]
        if end <= self._sent_chars:
            return ""
        text = self.output_text[self._sent_chars : end]
        self._sent_chars = end
        return text

    # ----------------------------------------------------------------- internals
    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._get_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            # NOTE: slicing by length (not removeprefix) is TGI's choice: the prefix decodes the
            # same inside the longer text for every tokenizer we know of.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = None
            return new_text[len(prefix_text) :]
        return ""

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop or self.num_output_tokens <= self.min_tokens or len(self.output_text) == old_len:
            return None
        text = self.output_text
        best_index, best_stop = -1, None
        for stop in self.stop:
            # Only text that the new characters can complete is searched again.
            index = text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        cut = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self.output_text = text[:cut]
        self._stopped = True
        return best_stop
