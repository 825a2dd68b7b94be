"""OutputProcessor: engine outputs in, delta/cumulative RequestOutputs out, stop strings, n > 1, aborts."""

from __future__ import annotations

import time

import pytest

from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.messages import EngineCoreOutput
from pagedserve.outputs import FinishReason, TokenLogprob
from pagedserve.sampling_params import SamplingParams


def feed(processor, request_id, index, token_ids, finish_at_end=None, stop_reason=None, logprobs=False):
    """One output per token, as the engine sends them; returns every ProcessedOutputs."""
    results = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        out = EngineCoreOutput(
            request_id=request_id,
            index=index,
            new_token_ids=[token_id],
            new_logprobs=[TokenLogprob(token_id, -0.5, 1)] if logprobs else None,
            finish_reason=finish_at_end if last else None,
            stop_reason=stop_reason if last else None,
            first_scheduled_time=time.monotonic() if i == 0 else None,
        )
        results.append(processor.process_outputs([out]))
    return results


def test_delta_outputs_join_to_full_text(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("Streaming text, with an emoji 🎉 inside.")
    processor.add_request("r1", "p", [1, 2, 3], SamplingParams(max_tokens=len(ids)), time.monotonic(), cumulative=False)
    results = feed(processor, "r1", 0, ids, FinishReason.LENGTH)
    texts, tokens = [], []
    for processed in results:
        assert processed.samples_to_stop == []
        for ro in processed.request_outputs:
            assert len(ro.outputs) == 1
            texts.append(ro.outputs[0].text)
            tokens += ro.outputs[0].token_ids
    assert "".join(texts) == tokenizer.decode(ids)
    assert tokens == ids
    final = results[-1].request_outputs[0]
    assert final.finished and final.outputs[0].finish_reason is FinishReason.LENGTH
    metrics = final.metrics
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    assert metrics.first_scheduled_time is not None and metrics.ttft >= 0
    assert not processor.has_unfinished_requests()


def test_cumulative_outputs(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("one two three")
    processor.add_request("r", None, [5], SamplingParams(logprobs=0), time.monotonic(), cumulative=True)
    results = feed(processor, "r", 0, ids, FinishReason.LENGTH, logprobs=True)
    final = results[-1].request_outputs[0].outputs[0]
    assert final.text == "one two three"
    assert final.token_ids == ids
    assert [lp.token_id for lp in final.logprobs] == ids
    second = results[1].request_outputs[0].outputs[0]
    assert second.token_ids == ids[:2]


def test_stop_string_stops_sample_and_is_reported(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("Count: 1, 2, 3, STOP, 4, 5")
    params = SamplingParams(stop=["STOP"], max_tokens=50)
    processor.add_request("r", None, [7], params, time.monotonic(), cumulative=False)
    results = feed(processor, "r", 0, ids)  # the engine never finishes it itself
    stops = [s for p in results for s in p.samples_to_stop]
    assert stops == [("r", 0)]
    text = "".join(o.text for p in results for ro in p.request_outputs for o in ro.outputs)
    assert text == "Count: 1, 2, 3, "
    last = [ro for p in results for ro in p.request_outputs][-1]
    assert last.finished
    assert last.outputs[0].finish_reason is FinishReason.STOP and last.outputs[0].stop_reason == "STOP"
    # tokens arriving after the stop (the engine had not heard yet) are ignored
    assert all(
        not p.request_outputs for p in results[results.index(next(p for p in results if p.samples_to_stop)) + 1 :]
    )


def test_n_samples_each_finish_once(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, max_tokens=4)
    processor.add_request("r", None, [9, 9], params, time.monotonic(), cumulative=False)
    seqs = [tokenizer.encode(t) for t in ("a b c d", "e f g h", "i j k l")]
    finishes = {}
    text = {0: "", 1: "", 2: ""}
    last = None
    for step in range(4):
        outs = [
            EngineCoreOutput("r", i, [seqs[i][step]], finish_reason=FinishReason.LENGTH if step == 3 else None)
            for i in range(3)
        ]
        processed = processor.process_outputs(outs)
        (ro,) = processed.request_outputs
        assert sorted(o.index for o in ro.outputs) == [0, 1, 2]
        for o in ro.outputs:
            text[o.index] += o.text
            if o.finish_reason is not None:
                finishes[o.index] = finishes.get(o.index, 0) + 1
        last = ro
    assert last.finished
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert [text[i] for i in range(3)] == ["a b c d", "e f g h", "i j k l"]


def test_request_finishes_only_when_all_samples_do(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(n=2), time.monotonic(), cumulative=True)
    tok = tokenizer.encode("x")[0]
    p1 = processor.process_outputs([EngineCoreOutput("r", 0, [tok], finish_reason=FinishReason.STOP)])
    assert not p1.request_outputs[0].finished
    assert len(p1.request_outputs[0].outputs) == 2
    p2 = processor.process_outputs([EngineCoreOutput("r", 1, [tok], finish_reason=FinishReason.LENGTH)])
    ro = p2.request_outputs[0]
    assert ro.finished
    assert [o.finish_reason for o in ro.outputs] == [FinishReason.STOP, FinishReason.LENGTH]


def test_abort_forgets_request_and_counts_it(tokenizer):
    processor = OutputProcessor(tokenizer, log_stats=True)
    processor.add_request("r", None, [1, 2], SamplingParams(), time.monotonic(), cumulative=False)
    feed(processor, "r", 0, tokenizer.encode("partial"))
    final = processor.abort_request("r")
    assert final.finished and [o.finish_reason for o in final.outputs] == [FinishReason.ABORT]
    assert processor.abort_request("r") is None
    assert not processor.has_unfinished_requests()
    late = processor.process_outputs([EngineCoreOutput("r", 0, [5])])
    assert late.request_outputs == []
    stats = processor.take_iteration_stats()
    assert [f.finish_reason for f in stats.finished_requests] == [FinishReason.ABORT]
    assert stats.num_prompt_tokens == 2
    assert stats.num_generation_tokens == len(tokenizer.encode("partial"))
    assert len(stats.time_to_first_tokens) == 1
    assert len(stats.inter_token_latencies) == stats.num_generation_tokens - 1


def test_finished_stats_split_the_request_into_vllms_phases(tokenizer):
    """queue (arrival -> scheduled), prefill (-> first token), decode (-> last token), per-token time."""
    processor = OutputProcessor(tokenizer, log_stats=True)
    arrival = time.monotonic() - 2.0
    processor.add_request("r", None, [1, 2], SamplingParams(n=2), arrival, cumulative=False)
    tok = tokenizer.encode("x")[0]
    processor.process_outputs(
        [EngineCoreOutput("r", 0, [tok], first_scheduled_time=arrival + 0.5), EngineCoreOutput("r", 1, [tok])]
    )
    for _ in range(3):  # the second sample runs longer: 4 tokens against 2
        time.sleep(0.01)
        processor.process_outputs([EngineCoreOutput("r", 1, [tok])])
    processor.process_outputs([EngineCoreOutput("r", 0, [tok], finish_reason=FinishReason.STOP)])
    time.sleep(0.01)
    processor.process_outputs([EngineCoreOutput("r", 1, [], finish_reason=FinishReason.LENGTH)])
    (finished,) = processor.take_iteration_stats().finished_requests
    assert finished.queue_time == pytest.approx(0.5) and finished.num_generation_tokens == 6
    assert finished.prefill_time >= 1.5 and finished.decode_time >= 0.03
    assert finished.inference_time == pytest.approx(finished.prefill_time + finished.decode_time)
    assert finished.e2e_latency >= finished.queue_time + finished.inference_time + 0.009  # the empty final output
    assert finished.time_per_output_token == finished.decode_time / 3  # the longest sample's 4 tokens

    processor.add_request("q", None, [1], SamplingParams(), time.monotonic(), cumulative=False)
    processor.abort_request("q")  # never scheduled: no phase but the whole life
    (aborted,) = processor.take_iteration_stats().finished_requests
    assert aborted.queue_time is None and aborted.prefill_time is None and aborted.decode_time is None
    assert aborted.inference_time is None and aborted.time_per_output_token is None


def test_prompt_logprobs_sent_once_in_delta_mode(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1, 2], SamplingParams(prompt_logprobs=0), time.monotonic(), cumulative=False)
    plp = [None, TokenLogprob(2, -1.0, 3)]
    first = processor.process_outputs([EngineCoreOutput("r", 0, [10], prompt_logprobs=plp)])
    second = processor.process_outputs([EngineCoreOutput("r", 0, [11], finish_reason=FinishReason.LENGTH)])
    assert first.request_outputs[0].prompt_logprobs == plp
    assert second.request_outputs[0].prompt_logprobs is None


def test_duplicate_request_id_rejected(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(), time.monotonic(), cumulative=False)
    try:
        processor.add_request("r", None, [1], SamplingParams(), time.monotonic(), cumulative=False)
    except ValueError as exc:
        assert "already in use" in str(exc)
    else:
        raise AssertionError("duplicate request id accepted")


def test_collector_merges_unread_deltas():
    import asyncio

    from pagedserve.engine.async_llm import RequestOutputCollector
    from pagedserve.outputs import CompletionOutput, RequestOutput

    def delta(index, text, ids, finish=None, finished=False):
        return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids, None, finish)], finished=finished)

    async def run():
        collector = RequestOutputCollector()
        collector.put(delta(0, "Hel", [1]))
        collector.put(delta(1, "A", [7]))
        collector.put(delta(0, "lo", [2], FinishReason.LENGTH, finished=True))
        merged = await collector.get()
        assert collector.get_nowait() is None
        return merged

    merged = asyncio.run(run())
    by_index = {c.index: c for c in merged.outputs}
    assert by_index[0].text == "Hello" and by_index[0].token_ids == [1, 2]
    assert by_index[0].finish_reason is FinishReason.LENGTH and by_index[1].text == "A"
    assert merged.finished


def test_collector_delivers_errors():
    import asyncio

    from pagedserve.engine.async_llm import RequestOutputCollector
    from pagedserve.engine.core_client import EngineDeadError

    async def run():
        collector = RequestOutputCollector()
        collector.put(EngineDeadError("gone"))
        await collector.get()

    try:
        asyncio.run(run())
    except EngineDeadError:
        pass
    else:
        raise AssertionError("error not delivered")
