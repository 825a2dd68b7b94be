"""ModelRunner: owns the model and the paged KV cache tensors, turns a SchedulerOutput into one forward pass and samples.

Each step it builds flat inputs for all scheduled requests (decodes first, then prefill
chunks and decodes with draft tokens) as a ForwardPlan: token ids, positions, block tables and
context lengths; runs the model once; takes logits only where a token is sampled (or prompt
logprobs are asked); and samples. Under tensor parallelism the plan goes to the other ranks first
(``send_plan``), which run ``run_plan`` alongside; sampling is this runner's alone.

A decode with draft tokens (speculative decoding) is sampled at each of its positions, position
``j`` as if drafts ``0..j-1`` had been accepted (penalties and ``min_tokens`` see them); drafts are
accepted while they equal the token sampled before them, and the first token that differs (or the
one after the last draft) ends the step's output. A draft is thus kept with exactly the probability
the model gives it, and every emitted token is a draw from the model's own distribution: the
rejection-sampling rule for drafts proposed with certainty, as prompt-lookup drafts are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.kernels import load_cpu_kernels
from pagedserve.models.attention import build_attention_metadata
from pagedserve.models.loader import LoadedModel
from pagedserve.models.quantize_model import pack_quantized_weights, weight_bytes
from pagedserve.outputs import TokenLogprob
from pagedserve.worker.cpu_fast_paths import can_pack_linear_weights, pack_linear_weights, use_fused_ops
from pagedserve.worker.draft_model import DraftModelProposer
from pagedserve.worker.forward_plan import ForwardPlan
from pagedserve.worker.host_memory import kv_cache_tensors
from pagedserve.worker.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions (``sampled[j]`` is the token
    sampled where ``drafts[j]`` was proposed)."""
    num = 0
    while num < len(drafts) and drafts[num] == sampled[num]:
        num += 1
    return num


class ModelRunner:
    """Runs the model over the paged cache. Invariant: ``kv_caches[layer]`` is
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` and block 0 is never written."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        use_cpu_kernels: bool = True,
        batch_size_hint: int = 64,
        draft: LoadedModel | None = None,
        send_plan: Callable[[ForwardPlan], None] | None = None,
    ) -> None:
        self.model = model
        self.send_plan = send_plan  # tensor parallelism: hands each step's plan to the other ranks
        # wall seconds spent in the model forward and the logits, cumulative (pagedserve:model_forward_seconds).
        # NOTE: on CUDA the calls only launch kernels; their run time then lands in the sampler's host sync.
        self.forward_seconds = 0.0
        # CPU seconds this process (all its threads: the matmul workers too) used meanwhile
        # (pagedserve:model_forward_cpu_seconds); what it used outside them is the serving overhead.
        self.forward_cpu_seconds = 0.0
        self.device = device
        self.block_size = block_size
        self.kv_caches = kv_cache_tensors(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        generator = torch.Generator(device=device).manual_seed(seed)
        kernels = load_cpu_kernels() if device.type == "cpu" and use_cpu_kernels else None
        self.kernels = kernels  # decode attention and cache writes in C++, or None for the PyTorch reference
        self.sampler = Sampler(vocab_size, generator, kernels.argmax_rows if kernels is not None else None)
        # the own generator of each seeded sample, by Request.key: made when the sample first samples, kept
        # while it is preempted (its recompute draws on where it left off), dropped once it is finished
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._prepare_weights(model, dtype, use_cpu_kernels, batch_size_hint)
        self.weight_bytes = weight_bytes(model)  # resident, packed and quantized copies included
        logger.info("model weights: %.1f MiB resident", self.weight_bytes / 2**20)
        # speculative decoding's draft model, over a KV cache of its own that shares the block tables
        self.drafter: DraftModelProposer | None = None
        if draft is not None:
            self._prepare_weights(draft.model, draft.dtype, use_cpu_kernels, batch_size_hint)
            self.drafter = DraftModelProposer(
                draft.model,
                num_layers=draft.num_layers,
                num_kv_heads=draft.num_kv_heads,
                head_dim=draft.head_dim,
                max_model_len=draft.max_model_len,
                num_blocks=num_blocks,
                block_size=block_size,
                dtype=draft.dtype,
                device=device,
                kernels=kernels,
                forward=self._in_forward,
            )
            draft_bytes = weight_bytes(draft.model)
            self.weight_bytes += draft_bytes
            logger.info("draft model weights: %.1f MiB resident", draft_bytes / 2**20)

    def _prepare_weights(
        self, model: nn.Module, dtype: torch.dtype, use_cpu_kernels: bool, batch_size_hint: int
    ) -> None:
        """Quantized and linear weights packed for the CPU kernels where they run."""
        kernels = self.kernels
        if kernels is not None and dtype == torch.bfloat16 and kernels.has_quant_linear():
            pack_quantized_weights(model, kernels)
        if use_cpu_kernels and can_pack_linear_weights(self.device, dtype):
            pack_linear_weights(model, batch_size_hint, kernels)
            if kernels is not None and dtype == torch.bfloat16:
                use_fused_ops(model, kernels)

    @torch.inference_mode()
    def execute_model(
        self, sched: SchedulerOutput, logits_mask: Callable[[torch.Tensor], None] | None = None
    ) -> ModelRunnerOutput:
        """One forward of ``sched``; ``logits_mask`` (structured outputs) edits the sampled rows' logits
        ``[rows, vocab]`` in place before sampling."""
        for key in sched.finished_req_ids:  # first: a finished request's id may be in use again here
            self._generators.pop(key, None)
        items = sched.scheduled
        copies = sched.block_copies
        if self.drafter is not None:
            self.drafter.forget(sched.finished_req_ids)
            if copies:  # the draft model reads the copied blocks too
                self._copy_blocks(copies)
                copies = []
            self.drafter.propose(items)  # the draft model's tokens into the slots the scheduler left
        plan, rows, owners = self._plan(items, copies)
        if self.send_plan is not None:
            self.send_plan(plan)  # the other tensor-parallel ranks run the same forward
        logits, prompt_logits = self.run_plan(plan)

        sampled: list[list[int]] = [[] for _ in items]
        logprobs: list[list[TokenLogprob] | None] = [None for _ in items]
        if rows:
            if logits_mask is not None:
                logits_mask(logits)
            tokens, token_logprobs = self.sampler(logits, rows)
            for owner, token, logprob in zip(owners, tokens, token_logprobs):
                sampled[owner].append(token)
                if logprob is not None:
                    logprobs[owner] = (logprobs[owner] or []) + [logprob]
            for k, item in enumerate(items):
                if item.spec_token_ids:
                    num_emitted = accepted_prefix(item.spec_token_ids, sampled[k]) + 1
                    if self.drafter is not None:
                        self.drafter.record_accepted(item, num_emitted - 1)
                    del sampled[k][num_emitted:]
                    if logprobs[k] is not None:
                        del logprobs[k][num_emitted:]
        prompt_logprobs = [
            self._prompt_logprobs(item, prompt_logits.get(k))
            if item.request.sampling_params.prompt_logprobs is not None
            else None
            for k, item in enumerate(items)
        ]
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _plan(
        self, items: list[ScheduledRequest], copies: list[tuple[int, int]]
    ) -> tuple[ForwardPlan, list[SamplingRow], list[int]]:
        """The step's forward as plain lists, with the sampling rows (and which item owns each)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []  # flat token index of each sampled row
        rows: list[SamplingRow] = []
        owners: list[int] = []  # which item each row belongs to
        prompt_logit_rows: list[tuple[int, int, int]] = []
        for k, item in enumerate(items):
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            first_row = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])  # with drafts: the last known token
            input_ids.extend(item.spec_token_ids)
            positions.extend(range(start, end))
            last = len(input_ids) - 1
            if request.sampling_params.prompt_logprobs is not None:
                # position p predicts token p + 1; only prompt tokens count
                num_prompt_rows = min(end, request.num_prompt_tokens - 1) - start
                if num_prompt_rows > 0:
                    prompt_logit_rows.append((k, first_row, num_prompt_rows))
            if item.spec_token_ids:  # one row per verified position: the last known token's, then each draft's
                first = last - len(item.spec_token_ids)
                for j in range(len(item.spec_token_ids) + 1):
                    sample_rows.append(first + j)
                    rows.append(self._sampling_row(item, 0, item.spec_token_ids[:j]))
                    owners.append(k)
                continue
            for s in range(item.num_samples):
                sample_rows.append(last)
                rows.append(self._sampling_row(item, s))
                owners.append(k)
        plan = ForwardPlan(
            block_copies=copies,
            input_ids=input_ids,
            positions=positions,
            num_computed_tokens=[item.request.num_computed_tokens for item in items],
            num_new_tokens=[item.num_new_tokens for item in items],
            block_ids=[item.request.block_ids for item in items],
            sample_rows=sample_rows,
            prompt_logit_rows=prompt_logit_rows,
        )
        return plan, rows, owners

    @torch.inference_mode()
    def run_plan(self, plan: ForwardPlan) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """The forward of ``plan``: the sampled rows' logits ``[rows, vocab]`` (None without rows) and the
        prompt-logprob rows' logits by request index. Every tensor-parallel rank runs this."""
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        meta = build_attention_metadata(
            plan.num_computed_tokens, plan.num_new_tokens, plan.block_ids, self.block_size, self.device, self.kernels
        )
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)  # [num_tokens]
        pos = torch.tensor(plan.positions, dtype=torch.long, device=self.device)  # [num_tokens]
        hidden = self._in_forward(self.model, ids, pos, self.kv_caches, meta)  # [num_tokens, hidden]
        logits = None
        if plan.sample_rows:
            if plan.sample_rows == list(range(hidden.shape[0])):
                last_hidden = hidden  # a pure decode step: every token is sampled once, in order
            else:
                last_hidden = hidden[torch.tensor(plan.sample_rows, device=self.device)]  # [rows, hidden]
            logits = self._in_forward(self.model.compute_logits, last_hidden)  # [rows, vocab]
        prompt_logits = {
            k: self.model.compute_logits(hidden[first : first + count])  # [count, vocab]
            for k, first, count in plan.prompt_logit_rows
        }
        return logits, prompt_logits

    def _in_forward(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """``fn(*args)``, its wall and CPU time added to ``forward_seconds`` / ``forward_cpu_seconds``."""
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        self.forward_seconds += time.perf_counter() - start
        self.forward_cpu_seconds += time.process_time() - start_cpu
        return out

    def _sampling_row(self, item: ScheduledRequest, sample: int, drafts: list[int] | None = None) -> SamplingRow:
        """The row of sample ``sample``; ``drafts``: the draft tokens taken as accepted before this position."""
        request = item.request
        output_token_ids = request.output_token_ids
        return SamplingRow(
            params=request.sampling_params,
            generator=self._generator(item, sample),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=output_token_ids + drafts if drafts else output_token_ids,
            eos_token_ids=request.eos_token_ids,
        )

    def _generator(self, item: ScheduledRequest, sample: int) -> torch.Generator | None:
        """The generator of sample ``index = item.request.index + sample`` (``sample > 0`` only at the fork point
        of sample 0), seeded with ``seed + index``; None without a seed (the sampler's shared generator)."""
        request = item.request
        seed = request.sampling_params.seed
        if seed is None:
            return None
        index = request.index + sample
        key = (request.request_id, index)
        generator = self._generators.get(key)
        if generator is None:
            generator = self._generators[key] = torch.Generator(device=self.device).manual_seed(
                (seed + index) % (2**63)
            )
        return generator

    def _prompt_logprobs(self, item: ScheduledRequest, logits: torch.Tensor | None) -> list[TokenLogprob | None]:
        """Logprobs of prompt tokens computed in this chunk from their rows' ``logits`` ``[m, vocab]``
        (the first prompt token has none)."""
        request = item.request
        first = request.num_computed_tokens
        result: list[TokenLogprob | None] = [None] if first == 0 else []
        if logits is None:
            return result
        m = logits.shape[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(request.prompt_token_ids[first + 1 : first + 1 + m], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        n = request.sampling_params.prompt_logprobs or 0
        top_v, top_i = logprobs.topk(n, dim=-1) if n else (None, None)
        for j in range(m):
            top = list(zip(top_i[j].tolist(), top_v[j].tolist())) if n else []
            result.append(TokenLogprob(int(targets[j]), float(chosen[j]), int(ranks[j]), top))
        return result

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        draft_caches = self.drafter.kv_caches if self.drafter is not None else []  # same block ids
        for cache in self.kv_caches + draft_caches:
            cache[:, dst] = cache[:, src]
