"""IncrementalDetokenizer with the default model's real tokenizer: UTF-8 hold-back, stop strings, specials."""

from __future__ import annotations

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is a plain ASCII sentence.",
    "héllo 日本語 🎉 world",
    "Emoji run: 👩‍👩‍👧‍👦🎉🚀 and math ∑∫√ and accents: àéîõü ñ ç",
    "中文字符测试，包含标点。",
    "  leading spaces\n\nnew lines\ttabs  ",
    "Ünïcödé combining: e\u0301 a\u0308",
]


def stream(detok: IncrementalDetokenizer, token_ids: list[int], per_update: int = 1, stop_terminated: bool = False):
    """Feed tokens like an engine; return the deltas and the stop string matched (if any)."""
    deltas: list[str] = []
    stop = None
    for start in range(0, len(token_ids), per_update):
        chunk = token_ids[start : start + per_update]
        last = start + per_update >= len(token_ids)
        stop = detok.update(chunk, stop_terminated and last)
        finished = stop is not None or last
        if last and stop is None:
            stop = detok.finish()
        deltas.append(detok.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("per_update", [1, 3])
def test_round_trip_matches_full_decode(tokenizer, text, per_update):
    prompt_ids = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    deltas, stop = stream(detok, ids, per_update)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode(" 🎉")
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), SamplingParams())
    for token_id in ids[:-1]:
        assert detok.update([token_id]) is None
        assert detok.get_next_output_text(False, delta=True) == ""
    detok.update([ids[-1]])
    assert detok.get_next_output_text(False, delta=True) == " 🎉"


def test_incomplete_tail_is_dropped_at_finish(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:-1])
    detok.finish()
    text = detok.get_next_output_text(True, delta=False)
    assert text == "ok" or text == "ok "
    assert "\ufffd" not in text


@pytest.mark.parametrize("per_update", [1, 2])
def test_stop_string_across_token_boundaries_never_leaks(tokenizer, per_update):
    text = "The answer is forty-two. Then the story continues for a while."
    stop = "forty-two"
    ids = tokenizer.encode(text)
    # the stop string must span several tokens for the test to mean anything
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    deltas, matched = stream(detok, ids, per_update)
    assert matched == stop
    assert "".join(deltas) == "The answer is "
    for i in range(1, len(deltas) + 1):
        sent = "".join(deltas[:i])
        assert "forty" not in sent and not sent.endswith("fort")


def test_stop_string_inside_one_multibyte_run(tokenizer):
    text = "価格は日本円です。以上"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["日本円"]))
    deltas, matched = stream(detok, ids)
    assert matched == "日本円"
    assert "".join(deltas) == "価格は"


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("one two three four five")
    params = SamplingParams(stop=[" three"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detok, ids)
    assert matched == " three"
    assert "".join(deltas) == "one two three"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["delta", "beta", "gam"]))
    deltas, matched = stream(detok, ids, per_update=len(ids))
    assert matched == "beta"
    assert "".join(deltas) == "alpha "


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here and stop there")
    params = SamplingParams(stop=["stop"], min_tokens=3, max_tokens=20)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detok, ids)
    assert matched == "stop"
    assert "".join(deltas) == "stop here and "


def test_skip_special_tokens(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [im_end] + tokenizer.encode(" again")
    skip = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=True))
    keep = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(skip, ids)[0]) == "Hi there again"
    assert "".join(stream(keep, ids)[0]) == "Hi there<|im_end|> again"


def test_eos_text_left_out_unless_included(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done.") + [eos]
    plain = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(plain, ids, stop_terminated=True)[0]) == "Done."
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    included = IncrementalDetokenizer(tokenizer, [], params)
    assert "".join(stream(included, ids, stop_terminated=True)[0]) == "Done.<|im_end|>"


def test_stop_token_id_text_is_left_out(tokenizer):
    ids = tokenizer.encode("Stop at the full stop.")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[ids[-1]]))
    assert "".join(stream(detok, ids, stop_terminated=True)[0]) == tokenizer.decode(ids[:-1])


def test_prompt_context_keeps_leading_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    ids = tokenizer.encode(" Paris, of course")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert "".join(stream(detok, ids)[0]) == " Paris, of course"


def test_cumulative_text_holds_back_partial_stop(tokenizer):
    ids = tokenizer.encode("abc END")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["ENDING"]))
    for token_id in ids:
        detok.update([token_id])
    held = detok.get_next_output_text(False, delta=False)
    assert held == "abc END"[: len("abc END") - 5]
    assert detok.get_next_output_text(True, delta=False) == "abc END"
