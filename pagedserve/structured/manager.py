"""StructuredOutputManager: the engine core's side of constrained decoding.

It owns the grammar compiler for the model's vocabulary (built in a background thread when the engine
starts), compiles each constrained request's spec on that thread while the step loop goes on (the
request waits, others step), and keeps one xgrammar matcher per constrained sample: each step it fills
the allowed-token bitmask of the constrained rows only, applies it to their logits before sampling,
and advances the matchers with the sampled tokens. A request verifying draft tokens has one row per
draft position: its matcher walks through the drafts to fill them, and is stepped back before the
accepted tokens advance it. Unconstrained rows are never touched.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pagedserve.config import ModelConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.messages import EngineCoreRequest
from pagedserve.structured.grammars import clean_error, compile_spec

logger = logging.getLogger(__name__)

COMPILER_CACHE_BYTES = 256 * 2**20  # compiled grammars kept (LRU by size), shared by all requests

SampleKey = tuple[str, int]  # (request_id, sample index)


def build_compiler(model_config: ModelConfig, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """An xgrammar GrammarCompiler over the model's tokenizer vocabulary (``vocab_size`` = logits width)."""
    import xgrammar as xgr

    from pagedserve.tokenizer import eos_token_ids as tokenizer_eos_ids
    from pagedserve.tokenizer import load_tokenizer, tokenizer_path

    tokenizer = load_tokenizer(tokenizer_path(model_config))
    stop_ids = sorted(set(eos_token_ids) | set(tokenizer_eos_ids(tokenizer)))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)


class StructuredOutputManager:
    """Compiles specs off the step loop and masks / advances the constrained samples. One caller (the
    engine's step loop) drives it; only the compiles run on its worker thread."""

    def __init__(self, compiler_factory: Callable[[], Any], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler = self._executor.submit(compiler_factory)  # first job on the thread: compiles wait for it
        self._pending: dict[str, tuple[EngineCoreRequest, concurrent.futures.Future]] = {}
        self._grammars: dict[str, Any] = {}  # request id -> compiled grammar (kept for its samples' matchers)
        self._matchers: dict[SampleKey, Any] = {}
        self.num_failed = 0

    # ----------------------------------------------------------------- compiles
    def submit(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        self._pending[request.request_id] = (request, self._executor.submit(self._compile, params))

    def _compile(self, params: Any) -> Any:
        return compile_spec(self._compiler.result(), params)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_compiled(self) -> tuple[list[EngineCoreRequest], list[tuple[EngineCoreRequest, str]]]:
        """Requests whose grammar is ready (to schedule now) and those whose compile failed (with why)."""
        ready: list[EngineCoreRequest] = []
        failed: list[tuple[EngineCoreRequest, str]] = []
        if not self._pending:
            return ready, failed
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            error = future.exception()
            if error is None:
                self._grammars[request_id] = future.result()
                ready.append(request)
            else:
                self.num_failed += 1
                failed.append((request, f"the output constraint did not compile: {clean_error(error)}"))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a compile to finish (the loop has nothing else to run)."""
        futures = [future for _, future in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            entry = self._pending.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    # ----------------------------------------------------------------- per step
    def release(self, finished: Iterable[SampleKey], live_request_ids: Callable[[str], bool]) -> None:
        """Forget the matchers of finished samples, and the grammar of requests no longer in flight."""
        for key in finished:
            self._matchers.pop(key, None)
            if not live_request_ids(key[0]):
                self._grammars.pop(key[0], None)

    def logits_mask(self, sched: SchedulerOutput) -> Callable[[torch.Tensor], None] | None:
        """The in-place mask of this step's constrained rows (rows in the runner's order: per scheduled
        request, its ``num_samples`` samples), or None when no row is constrained."""
        if not self._grammars:  # no constrained request in flight: nothing to look at
            return None
        constrained: list[tuple[int, Any]] = []
        # rows whose grammar has ended (only reachable with ignore_eos, or after a stop token among the
        # drafts): stop tokens only, so nothing follows the complete output
        ended: list[tuple[int, tuple[int, ...]]] = []
        drafted: list[tuple[int, Any, list[int], tuple[int, ...]]] = []  # (first row, matcher, drafts, stops)
        num_rows = 0
        for item in sched.scheduled:
            request = item.request
            if item.num_samples and request.sampling_params.structured_outputs is not None:
                if item.spec_token_ids:
                    matcher = self._matcher(request.request_id, request.index, request.eos_token_ids)
                    drafted.append((num_rows, matcher, item.spec_token_ids, request.eos_token_ids))
                else:
                    for s in range(item.num_samples):
                        matcher = self._matcher(request.request_id, request.index + s, request.eos_token_ids)
                        if not matcher.is_terminated():
                            constrained.append((num_rows + s, matcher))
                        elif request.eos_token_ids:
                            ended.append((num_rows + s, request.eos_token_ids))
            num_rows += item.num_logit_rows
        if not constrained and not ended and not drafted:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # [num_rows, ceil(vocab / 32)] int32
        for row, matcher in constrained:
            matcher.fill_next_token_bitmask(bitmask, row)
        indices = [row for row, _ in constrained]
        for first_row, matcher, drafts, stop_ids in drafted:
            # row j is sampled after drafts[:j]: walk the matcher through the drafts, then step it back
            walked = 0
            for j in range(len(drafts) + 1):
                if matcher.is_terminated():  # a stop token among the drafts completed the output
                    if stop_ids:
                        ended.append((first_row + j, stop_ids))
                    break
                matcher.fill_next_token_bitmask(bitmask, first_row + j)
                indices.append(first_row + j)
                if j == len(drafts) or not matcher.accept_token(drafts[j]):
                    break  # a draft outside the grammar is masked out at its row: nothing after it is accepted
                walked += 1
            if walked:
                matcher.rollback(walked)
        vocab_size = self.vocab_size

        def apply(logits: torch.Tensor) -> None:  # logits: [num_rows, >= vocab]
            if indices:
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices)
            for row, stop_ids in ended:
                keep = logits[row, list(stop_ids)].clone()  # [num_stop_ids]
                logits[row].fill_(float("-inf"))
                logits[row, list(stop_ids)] = keep

        return apply

    def accept(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Advance each constrained sample's matcher with the token(s) it sampled this step: one per
        sample, or a drafting sample's accepted drafts and its next token."""
        if not self._matchers:
            return
        for item, tokens in zip(sched.scheduled, result.sampled_token_ids):
            request = item.request
            if not tokens or request.sampling_params.structured_outputs is None:
                continue
            if item.spec_token_ids:
                samples = [(request.index, token) for token in tokens]
            else:
                samples = [(request.index + s, token) for s, token in enumerate(tokens)]
            for index, token in samples:
                matcher = self._matchers.get((request.request_id, index))
                if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(token):
                    logger.debug("sample %s/%d: token %d outside its grammar", request.request_id, index, token)

    def _matcher(self, request_id: str, index: int, eos_token_ids: tuple[int, ...]) -> Any:
        matcher = self._matchers.get((request_id, index))
        if matcher is None:
            import xgrammar as xgr

            matcher = xgr.GrammarMatcher(self._grammars[request_id], override_stop_tokens=list(eos_token_ids))
            self._matchers[(request_id, index)] = matcher
        return matcher

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
