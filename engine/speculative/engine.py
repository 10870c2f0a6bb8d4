"""An engine that speculates: before each step, running sequences propose up to K tokens
(n-gram lookup in their own prompt and output); the step scores them as ragged rows of
K + 1 query tokens beside every other sequence's tokens, and rejection sampling keeps a prefix
of each run (engine/speculative/rejection.py), so the output is distributed exactly as
without speculation.

KV of rejected proposals is discarded by not counting it: a verified sequence's computed
length advances by its accepted tokens only, the next step overwrites the rest, and tail pages
holding nothing computed go back to the free list.

Speculation is skipped for a step with more than `disable_by_batch_size` sequences and for a
sequence whose acceptance rate stays below `min_acceptance_rate` (until it tries again,
`acceptance_reprobe_steps` steps later); a step where nobody proposes runs the plain step. A
sequence with structured output speculates within its grammar (engine/speculative/grammar.py:
proposals cut where the grammar rejects them, a token bitmask per verified position). The loop
is the synchronous one: schedule, propose, run, wait, record.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import Mesh

from engine.config import ModelConfig, SpeculativeConfig
from engine.errors import XlaserveError
from engine.llm_engine import (
    LLMEngine,
    _Launched,
    _Parent,
    _record_prompt_logprobs,
)
from engine.models.layers import Params
from engine.output_processor import StopDecision
from engine.protocol import EngineStats
from engine.request import Request, RequestOutput
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.speculative import grammar
from engine.speculative.draft import DraftModelProposer, NgramProposer, Proposals, Proposer
from engine.speculative.verify import Verifier, VerifyResult
from sharding.layout import ShardingLayout


@dataclass
class SpecDecodeCounters:
    """vLLM's speculative decoding counters: proposals made, tokens proposed, tokens
    accepted, and accepted tokens by position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


@dataclass
class _Acceptance:
    """A request's proposed and accepted tokens since its window started, and the decode steps
    it has run without speculation since its acceptance was found too low."""

    proposed: int = 0
    accepted: int = 0
    steps_off: int = 0


class SpeculativeEngine(LLMEngine):
    """`LLMEngine` with speculative decoding as `speculative` configures it."""

    def __init__(
        self,
        *args: Any,
        speculative: SpeculativeConfig,
        draft: tuple[ModelConfig, Params] | None = None,
        warm_up: bool = True,
        mesh: Mesh | None = None,
        layout: ShardingLayout | None = None,
        **kwargs: Any,
    ):
        """`draft`: the draft model's config and parameters (method draft_model), sharded over
        `mesh` as `layout` says, as the target is."""
        if (speculative.method == "draft_model") != (draft is not None):
            raise XlaserveError("a draft model's weights go with method 'draft_model' only")
        super().__init__(*args, warm_up=False, mesh=mesh, layout=layout, **kwargs)
        self.async_scheduling = False  # proposals are made from the tokens the host knows
        self.speculative = speculative
        self.verifier = Verifier(self.runner, speculative)
        self.proposer: Proposer = NgramProposer(speculative)
        if draft is not None:
            self.proposer = self._draft_proposer(*draft, mesh, layout)
        self.spec_counters = SpecDecodeCounters(
            accepted_per_position=[0] * speculative.num_speculative_tokens
        )
        self._acceptance: dict[str, _Acceptance] = {}
        if warm_up:  # the speculative parts first: warm-up ends when the plain ones are done
            while self.proposer.warm_up_one():
                pass
            self.verifier.warm_up()
            self.runner.warm_up()

    def _draft_proposer(
        self, cfg: ModelConfig, params: Params, mesh: Mesh | None, layout: ShardingLayout | None
    ) -> DraftModelProposer:
        if cfg.vocab_size != self.cfg.vocab_size:
            raise XlaserveError(
                f"the draft model's vocabulary ({cfg.vocab_size} tokens) is not the target's "
                f"({self.cfg.vocab_size}); a draft model must share the target's tokenizer"
            )
        return DraftModelProposer(
            cfg, params, self.runner, self.scheduler_config, self.speculative, mesh, layout
        )

    def warm_up_step(self) -> bool:
        return (
            self.proposer.warm_up_one() or self.verifier.warm_up_one() or self.runner.warm_up_one()
        )

    def stats(self) -> EngineStats:
        c = self.spec_counters
        return _with_spec(super().stats(), c, len(self.verifier.compiled.variants()))

    # ---- proposing -------------------------------------------------------------------------

    def _propose(self, out: SchedulerOutput) -> Proposals | None:
        """Gives decoding sequences their proposals (in place, with pages for them); None if
        nobody proposes (a plain step)."""
        rooms = self._rooms(out)
        if not any(rooms):
            self.proposer.follow(out, self.kv_cache)
            return None
        proposals = self.proposer.propose(out, rooms, self.kv_cache)
        kept = []
        for i, (scheduled, drafts) in enumerate(zip(out.scheduled, proposals.drafts, strict=True)):
            request = scheduled.request
            drafts = grammar.valid_prefix(self.grammars.get(request.request_id), drafts)
            kept.append(drafts)
            if rooms[i] > len(drafts):
                self.kv_cache.shrink(request.request_id, request.num_tokens + len(drafts))
            if drafts:
                out.scheduled[i] = ScheduledRequest(
                    request, scheduled.start, 1 + len(drafts), tuple(drafts)
                )
        return dataclasses.replace(proposals, drafts=kept) if any(kept) else None

    def _rooms(self, out: SchedulerOutput) -> list[int]:
        """How many tokens each scheduled sequence may propose, with pages allocated for them
        (0 for all in a step above `disable_by_batch_size` sequences)."""
        if len(out.scheduled) > min(self.speculative.disable_by_batch_size, self.verifier.max_seqs):
            return [0] * len(out.scheduled)
        budget = self.scheduler_config.max_num_batched_tokens - out.num_tokens
        rooms = []
        for scheduled in out.scheduled:
            room = min(self._room(scheduled), budget)
            request = scheduled.request
            if (
                room > 0
                and self.kv_cache.allocate(request.request_id, request.num_tokens + room) is None
            ):
                room = 0
            budget -= room
            rooms.append(room)
        return rooms

    def _room(self, scheduled: ScheduledRequest) -> int:
        request = scheduled.request
        params = request.sampling_params
        if scheduled.num_new_tokens != 1 or not scheduled.completes_sequence:
            return 0  # prefilling
        if not self._accepts_enough(request):
            return 0
        num_out = len(request.output_token_ids)
        room = min(self.speculative.num_speculative_tokens, params.max_tokens - num_out - 1)
        if num_out < params.min_tokens:  # every position must share min_tokens' banned ids
            room = min(room, params.min_tokens - num_out - 1)
        return max(room, 0)

    def _accepts_enough(self, request: Request) -> bool:
        """Whether the request speculates in this step: yes until its window is full, then
        while its acceptance rate is high enough; one found too low sits out
        `acceptance_reprobe_steps` steps in which it could have speculated, then starts a
        fresh window (acceptance changes as the output does: a quoting passage may follow
        free text)."""
        config = self.speculative
        seen = self._acceptance.get(request.request_id)
        if seen is None or seen.proposed < config.acceptance_window:
            return True
        if seen.accepted >= config.min_acceptance_rate * seen.proposed:
            return True
        seen.steps_off += 1
        if (
            config.acceptance_reprobe_steps is None
            or seen.steps_off <= config.acceptance_reprobe_steps
        ):
            return False
        self._acceptance[request.request_id] = _Acceptance()
        return True

    # ---- the loop ----------------------------------------------------------------------------

    def launch_step(self) -> _Launched | None:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return None
        proposals = self._propose(out)
        if proposals is None:
            return self._dispatch(out)  # the plain step (its token counts as pending)
        params = [s.request.sampling_params for s in out.scheduled]
        options = self.runner.options(
            penalties=any(p.uses_penalties for p in params),
            logprobs=any(p.logprobs is not None for p in params),
            prompt_logprobs=any(p.prompt_logprobs is not None for p in params),
        )
        pending = self.verifier.dispatch(
            out,
            self.kv_cache,
            options,
            grammar.draft_filler(self.grammars, out, self.verifier.k),
            proposals.probs,
        )
        completed = self.scheduler.update_after_step(out)
        return _Launched(out, completed, pending)  # type: ignore[arg-type]

    def finish_step(self, launched: _Launched) -> list[RequestOutput]:
        if not isinstance(launched.pending, VerifyResult):
            return super().finish_step(launched)
        out, completed = launched.out, launched.completed
        result = self.verifier.fetch(launched.pending)
        if result.prompt is not None:
            _record_prompt_logprobs(out, result.prompt)
        self.counters.num_steps += 1
        self.counters.num_computed_prompt_tokens += out.num_prompt_tokens
        return self._postprocess_runs(out, completed, result)

    def _postprocess_runs(
        self, out: SchedulerOutput, completed: list[Request], result: VerifyResult
    ) -> list[RequestOutput]:
        row = {s.request.request_id: i for i, s in enumerate(out.scheduled)}
        progressed: dict[str, tuple[_Parent, list[int]]] = {}
        now = time.monotonic()
        for request in completed:
            i = row[request.request_id]
            num_proposed = len(out.scheduled[i].draft_token_ids)
            num_accepted = int(result.runs.num_emitted[i]) - 1
            self._record_acceptance(request, num_proposed, num_accepted)
            finished = False
            for j in range(num_accepted + 1):
                finished = self._accept_token(request, result, i, j, now)
                if finished:
                    break
            if not finished:
                self._keep_accepted(request, num_accepted)
            parent, index = self._child_parent.get(request.request_id, (None, 0))
            if parent is None:  # every token of it was recorded and the request is gone
                continue
            if not (finished or parent.outputs[index].due(request)):
                continue
            progressed.setdefault(parent.request_id, (parent, []))[1].append(index)
        return [self._request_output(p, indices) for p, indices in progressed.values()]

    def _accept_token(
        self, request: Request, result: VerifyResult, i: int, j: int, now: float
    ) -> bool:
        """Records emitted token j of row i as the plain loop records a sampled token; whether
        the sequence finished with it."""
        runs = result.runs
        token = int(runs.token_ids[i, j])
        k = request.sampling_params.logprobs
        entry = None
        if k is not None:
            entry = {
                int(t): float(lp)
                for t, lp in zip(runs.top_ids[i, j, :k], runs.top_logprobs[i, j, :k], strict=True)
            }
            entry[token] = float(runs.logprobs[i, j])
        return self._record_token(request, token, entry, now)[2]

    def _finish(self, parent: _Parent, index: int, decision: StopDecision) -> None:
        super()._finish(parent, index, decision)
        self._acceptance.pop(parent.children[index].request_id, None)

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.get(request_id)
        for child in parent.children if parent is not None else ():
            self._acceptance.pop(child.request_id, None)
        super().abort_request(request_id)

    def _keep_accepted(self, request: Request, num_accepted: int) -> None:
        """The accepted proposals' K/V counts as computed; pages past the sequence go back."""
        request.num_computed_tokens += num_accepted
        self.kv_cache.commit_full_pages(
            request.request_id,
            request.all_token_ids,
            request.num_computed_tokens,
            request.cache_salt,
        )
        self.kv_cache.shrink(request.request_id, request.num_tokens)

    def _record_acceptance(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self.spec_counters.record(num_proposed, num_accepted)
        seen = self._acceptance.setdefault(request.request_id, _Acceptance())
        seen.proposed += num_proposed
        seen.accepted += num_accepted


def _with_spec(stats: EngineStats, c: SpecDecodeCounters, num_variants: int) -> EngineStats:
    return dataclasses.replace(
        stats,
        num_step_variants=stats.num_step_variants + num_variants,
        spec_decode_num_drafts=c.num_drafts,
        spec_decode_num_draft_tokens=c.num_draft_tokens,
        spec_decode_num_accepted_tokens=c.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(c.accepted_per_position),
    )
