"""LLMEngine: one synchronous step = schedule -> run the model -> update -> outputs.

The engine glues the scheduler (who runs, which blocks), the model runner (tensors, forward,
sampling) and, when it owns a tokenizer, incremental detokenization with stop strings. It is
single-threaded: `AsyncEngine` drives it from one background thread.

Disaggregation: with a KV transport injected, the engine owns a `KVConnector`
(engine/kv_connector.py) for its role and calls six of its members: `add_send`, `start_load`,
`layer_hook`, `send_report`, `poll` and (a failed construction) `close`. Each step first applies
what the connector's `poll()` reports (sends that ended, loads that arrived, verified or failed),
then schedules; a prefill step hands the connector's per-layer hook to the model runner, so K/V
leaves as it is written. `wakeup` is set whenever a transfer ends, for the thread that drives the
engine to wait on. The connector verifies and counts everything it receives; what the prefill
worker answers reaches it through `AsyncEngine` (`report_kv_producer`), not through this class.

Failure contract: if the model runner raises, every request of that batch ends with
finish_reason "error" and its blocks are freed; the engine keeps serving the others.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import StreamDelta, TokenLogprob
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.block_hash import DEFAULT_HASH_ALGORITHM, CacheSalt
from engine.kv_connector import KVConnector, KVTransport
from engine.kv_hooks import ImportPlan, KVConnectorConfig, KVDestination, LoadDone, SendDone
from engine.scheduler import Scheduler
from engine.step_types import SampledToken, SchedulerStats, StepOutput
from engine.structured_output import GrammarCompiler

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int], Sequence[dict]]


def token_logprobs(token_ids: Sequence[int], sampled: Sequence[SampledToken | None]) -> list[TokenLogprob]:
    """A delta's logprobs of `token_ids` (those sampled with one)."""
    return [TokenLogprob(t, lp.logprob, lp.top_logprobs or []) for t, lp in zip(token_ids, sampled)
            if lp is not None and lp.logprob is not None]


def _prefill_tokens_left(request: Request) -> int:
    """The tokens `request` must still compute before it decodes: its prompt's, a resumed
    request's delivered outputs, and every output of one preempted by recompute (its KV is gone);
    0 for a request that decodes (one token left after an output: that step samples)."""
    left = request.num_tokens - request.num_computed_tokens
    return left if left > 1 or not request.output_token_ids else 0


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None,
                 kv_transport: Callable[[Any, Callable[[str], None]], KVTransport] | None = None,
                 kv_connector_config: KVConnectorConfig | None = None) -> None:
        """`runner` and `tokenizer` default to the real ones for `config.model` (a runner passed
        in comes with its tokenizer, or None: then prompts must be token ids).
        `kv_transport(kv_cache, on_transfer_end)` builds the KV connector's sender (prefill role)
        or receiver (decode role) over the runner's `transfer_cache` (its KV cache, or with tensor
        parallelism rank 0's cache of every head), e.g. with `kvtransfer.create_sender`."""
        self.config = config
        if runner is None:
            from engine.model.loader import resolve_model
            from engine.model_runner import ModelRunner
            from engine.tokenizer import Tokenizer
            loaded = resolve_model(config.model)
            tokenizer = tokenizer or Tokenizer.from_pretrained(loaded.model_dir)
            runner = ModelRunner(config, loaded)  # last: with TP it starts processes (see close())
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.wakeup = threading.Event()  # set when a KV transfer ends
        self.kv_connector: KVConnector | None = None
        try:  # a failure from here on ends the runner's tensor-parallel followers (close())
            if kv_transport is not None:
                kv_cache = runner.transfer_cache
                self.kv_connector = KVConnector(config.role, kv_connector_config or KVConnectorConfig(),
                                                kv_cache.layers, config.cache.block_size, DEFAULT_HASH_ALGORITHM,
                                                runner.vocab_size, lambda on_end: kv_transport(kv_cache, on_end),
                                                self.wakeup.set,
                                                shards=runner.kv_shards, layer_windows=kv_cache.layer_windows)
            self.scheduler = Scheduler(config.scheduler, config.cache, runner.num_blocks, self.max_model_len,
                                       role=config.role, kv_connector=self.kv_connector,
                                       num_swap_slots=runner.num_swap_slots,
                                       num_host_slots=runner.num_host_cache_slots,
                                       speculative=config.speculative, kv_groups=runner.kv_groups)
        except BaseException:  # e.g. the Scheduler refused the config: nothing may outlive the refusal
            if self.kv_connector is not None:
                try:  # its I/O thread, listening socket and fds
                    self.kv_connector.close()
                except Exception:  # the construction's own error is the one to raise
                    logger.exception("closing the KV transport of an engine that failed to start")
            self.close()
            raise
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.last_step_idle = True  # the last step scheduled nothing (e.g. all requests wait for KV)

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        prompt = list(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
        return prompt

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     priority: int = 0, cache_salt: str | CacheSalt | None = None, num_resumed_tokens: int = 0,
                     kv_destination: KVDestination | None = None) -> Request:
        """Tokenize and validate (raises ValueError for a client's mistake); no engine state changes,
        so any thread may call it. `num_resumed_tokens`: the prompt's last N token ids are output
        tokens a failed worker already delivered (a migrated generation; see `Request`)."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if not 0 <= num_resumed_tokens < len(token_ids):
            raise ValueError(f"num_resumed_tokens ({num_resumed_tokens}) must leave at least one prompt token "
                             f"of the {len(token_ids)} given")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, leaving no room to generate")
        if self.tokenizer is not None:
            bad = [t for t in token_ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.tokenizer.vocab_size})")
        split = len(token_ids) - num_resumed_tokens
        grammar = None
        if params.structured_output is not None:
            grammar = self._grammar_compiler().state(params.structured_output)
        return Request(request_id or f"req-{next(self._ids)}", token_ids[:split], params,
                       eos_token_ids=self.eos_token_ids, priority=priority, cache_salt=cache_salt,
                       resumed_output_token_ids=token_ids[split:], grammar=grammar, kv_destination=kv_destination)

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on the first structured-output request (it indexes the whole vocabulary)."""
        with self._grammar_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this engine has none")
                self._grammars = GrammarCompiler(self.tokenizer.hf_tokenizer, self.runner.vocab_size,
                                                 self.eos_token_ids)
            return self._grammars

    def add(self, request: Request, detokenize: bool = True) -> None:
        """Queue a request (ValueError if invalid). One with a `kv_destination` (prefill role)
        sends its prompt's KV there as it is computed."""
        if request.kv_destination is not None and self.kv_connector is None:
            raise ValueError("this engine sends no KV: it has no KV connector")
        self.scheduler.add_request(request)
        if request.kv_destination is not None:
            try:
                self.kv_connector.add_send(request)
            except Exception:
                self.scheduler.abort(request.request_id)  # never scheduled: nothing else to undo
                raise
        if detokenize and self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.all_token_ids, request.sampling_params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | CacheSalt | None = None, detokenize: bool = True) -> Request:
        request = self.make_request(prompt, params, request_id, priority, cache_salt)
        self.add(request, detokenize)
        return request

    def abort(self, request_id: str) -> StreamDelta | None:
        final = self.scheduler.abort(request_id)
        return self._to_delta(final) if final is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Release what outlives the object: the model runner's tensor-parallel followers
        (engine/tp_worker.py). Idempotent; nothing to do without tensor parallelism."""
        self.runner.close()

    @property
    def broken(self) -> str | None:
        """Why this engine cannot run another step (its model runner's tensor-parallel group
        broke: restart it), or None."""
        return self.runner.broken

    # ---- disaggregation roles (run on the engine thread; see engine/kv_hooks.py) ------------

    def add_imported(self, request: Request, detokenize: bool = False) -> ImportPlan | None:
        """Decode role: allocate the prompt's blocks after this worker's prefix-cache match; the
        request waits for its KV (raises ValueError / KVCacheFullError, nothing changed). If its
        host-cache copies fail, the request ends with an error and RuntimeError is raised.

        With a KV connector, the receiver expects the blocks to fill, unless the uncached tail is
        below the local-prefill threshold: then the request is prefilled here and None returned.
        The caller asks the prefill worker for the plan's blocks and hands its answer to the
        connector (`AsyncEngine.report_kv_producer`); the step loop does the rest."""
        plan = self.scheduler.add_imported_request(request)
        # Blocks evicted for this request are saved to the host tier before the transfer writes
        # into them, and its host-tier hits are copied back now.
        offloads, reloads = self.scheduler.take_host_copies()
        try:
            self._copy_kv(offloads=offloads, reloads=reloads)
        except Exception as exc:
            self.scheduler.finish_with_error(request.request_id, f"KV host cache copy failed: {exc}")
            self._host_tier_failed()
            raise RuntimeError(f"KV host cache copy failed: {exc}") from exc
        if detokenize and self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.all_token_ids, request.sampling_params)
        if self.kv_connector is None:
            return plan
        try:
            expected = self.kv_connector.start_load(request, plan,
                                                    streamable=request.request_id not in self._detokenizers)
        except Exception as exc:
            self.scheduler.finish_with_error(request.request_id, f"cannot expect the KV: {exc}")
            self._detokenizers.pop(request.request_id, None)  # its output never goes out: the caller gets the error
            raise RuntimeError(f"cannot expect the KV: {exc}") from exc
        if not expected:
            self.scheduler.fail_import(request.request_id, True)
            return None
        return plan

    def finish_import(self, request_id: str, first_token: SampledToken) -> StreamDelta:
        """Decode role without a KV connector, driving an import by hand: every block to fill
        was written; append the prefill worker's first token."""
        if self.kv_connector is not None:
            raise RuntimeError("this engine's KV connector finishes its imports")
        return self._to_delta(self.scheduler.finish_import(request_id, first_token))

    def stats(self) -> tuple[SchedulerStats, int]:
        """Scheduler counters and the prefill work queued: the tokens still to compute before
        each waiting or running request decodes (the KV connector counts its own failures)."""
        scheduler = self.scheduler
        queued = sum(_prefill_tokens_left(r) for r in scheduler.waiting + scheduler.running)
        return scheduler.stats(), queued

    def take_kv_events(self):
        """KV-cache events since the last call (engine/kv_events.py; [] unless `cache.kv_events`)."""
        return self.scheduler.block_manager.take_kv_events()

    def kv_snapshot(self):
        """The prefix cache's whole state as KV-cache events (a subscriber's first batch)."""
        return self.scheduler.block_manager.kv_snapshot()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        return self.apply_kv_transfers() + self.run_batch()

    def apply_kv_transfers(self) -> list[StreamDelta]:
        """The first half of a step: what the KV connector reports. Ended sends finish (or fail)
        their SENDING_KV requests; loads admit their request with the producer's first token, or
        fall back / fail it. A driver that streams (AsyncEngine) delivers these deltas before it
        calls `run_batch`, so an imported request's first token, or a prefill worker's finished
        send, does not wait for a model step it takes no part in."""
        if self.kv_connector is None:
            return []
        deltas = []
        for done in self.kv_connector.poll():
            try:
                deltas.extend(self._apply(done))
            except Exception as exc:  # ends that request, never the step
                logger.exception("applying the KV transfer outcome of %s failed", done.request_id)
                deltas.extend(self._fail([done.request_id], f"internal error: {exc}"))
        return deltas

    def run_batch(self) -> list[StreamDelta]:
        """The second half of a step: schedule, run the model, update."""
        batch = self.scheduler.schedule()
        self.last_step_idle = batch.is_empty
        if batch.is_empty:
            return []
        return self._run(batch)

    def _apply(self, done: SendDone | LoadDone) -> list[StreamDelta]:
        if isinstance(done, SendDone):
            final = self.scheduler.finish_sending(done.request_id, done.result.error)
            if final is None:
                return []
            delta = self._to_delta(final)
            delta.kv_send = done.result
            return [delta]
        if done.error is None:
            out = self.scheduler.finish_import(done.request_id, done.first_token, done.complete_blocks)
        else:
            logger.warning("%s: %s", done.request_id, done.error)
            out = self.scheduler.fail_import(done.request_id, done.fallback, done.error,
                                             done.first_token if done.first_token_streamed else None)
            if out is None:  # a fallback with no token yet: say now how the KV came (it did not), so
                # the decode worker cancels the prefill worker's side at once, not at the first local token
                request = self.scheduler.get_request(done.request_id)
                if request is None or request.kv_import is None:
                    return []
                delta = StreamDelta(done.request_id, [], num_prompt_tokens=request.num_prompt_tokens)
                delta.kv_import, request.kv_import = request.kv_import, None
                return [delta]
        delta = self._to_delta(out)
        if done.first_token_streamed:  # the caller has it (KVConnector.stream_first_token)
            delta.new_token_ids, delta.new_logprobs = [], []
        return [delta]

    def _run(self, batch) -> list[StreamDelta]:
        # An internal failure ends the requests it touched, never the engine.
        try:
            self._copy_kv(batch.kv_offload, batch.swap_out, batch.swap_in, batch.kv_reload)
        except Exception as exc:
            # Victims whose KV was being saved, and this step's requests (some were getting
            # theirs back), have no trustworthy KV any more; nor has any cached block.
            swapped = [r for r in batch.preempted_ids
                       if (victim := self.scheduler.get_request(r)) is not None and victim.swap_slots]
            finals = self._fail([seq.request.request_id for seq in batch.seqs] + swapped, f"KV copy failed: {exc}")
            if batch.kv_offload or batch.kv_reload:
                self._host_tier_failed()
            return finals
        try:
            hook = self.kv_connector.layer_hook(batch.seqs) if self.kv_connector is not None else None
            started = time.perf_counter()
            sampled = self.runner.execute(batch, hook)
            self.scheduler.observe_step(batch, time.perf_counter() - started)
        except Exception as exc:
            logger.exception("model step failed")
            return self._fail([seq.request.request_id for seq in batch.seqs], f"internal error: {exc}")
        return [self._to_delta(out) for out in self.scheduler.update(batch, sampled)]

    def _copy_kv(self, offloads=(), swap_out=(), swap_in=(), reloads=()) -> None:
        """The KV copies a scheduling decision queued, before anything else touches the cache:
        reads of blocks first (host-tier offloads, swap-outs), then writes (swap-ins, reloads)."""
        try:
            if offloads:
                self.runner.offload(offloads)
            if swap_out or swap_in:
                self.runner.swap(swap_out, swap_in)
            if reloads:
                self.runner.reload(reloads)
        except Exception:
            logger.exception("KV swap or host cache copy failed")
            raise

    def _host_tier_failed(self) -> None:
        """A host-tier copy failed (its requests already ended): drop the whole host tier and every
        device block in the prefix cache that no request holds, since a failed reload may have
        left one of them with wrong KV."""
        self.scheduler.block_manager.reset_prefix_cache()

    def _fail(self, request_ids: list[str], message: str) -> list[StreamDelta]:
        finals = (self.scheduler.finish_with_error(request_id, message) for request_id in request_ids)
        return [self._to_delta(final) for final in finals if final is not None]

    def _to_delta(self, out: StepOutput) -> StreamDelta:
        request = self.scheduler.get_request(out.request_id)
        delta = StreamDelta(request_id=out.request_id, new_token_ids=list(out.new_token_ids),
                            new_logprobs=token_logprobs(out.new_token_ids, out.new_logprobs),
                            finished=out.finished, finish_reason=out.finish_reason,
                            num_cached_tokens=out.num_cached_tokens, error=out.error,
                            invalid_request=out.invalid_request)
        if request is not None:
            delta.num_prompt_tokens = request.num_prompt_tokens
            if request.status is RequestStatus.SENDING_KV and out.new_token_ids:
                delta.kv_send = self.kv_connector.send_report(out.request_id)
            if request.kv_import is not None and (out.new_token_ids or out.finished):
                delta.kv_import, request.kv_import = request.kv_import, None
            if (request.prompt_logprobs is not None and out.new_token_ids
                    and request.num_output_tokens - request.num_resumed_tokens == len(out.new_token_ids)):
                delta.prompt_logprobs = list(request.prompt_logprobs)  # on the first output token's delta
        detok = self._detokenizers.get(out.request_id)
        if detok is not None:
            if out.new_token_ids or out.finished:
                change = self._detokenize(detok, delta, request)
                if change.stopped:
                    # A stop string matched: the text was cut there, so the reason is "stop" even
                    # when the same token also reached max_tokens; end the request now (frees its blocks).
                    if not out.finished:
                        self.scheduler.abort(out.request_id)
                    delta.finished, delta.finish_reason = True, "stop"
            if delta.finished:
                del self._detokenizers[out.request_id]
        return delta

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, delta: StreamDelta, request: Request | None):
        """Add the delta's tokens to its text. With stop strings, several tokens (a speculative
        step's) go in one at a time, and those after the one that completes a stop string are
        dropped from the delta, as if they had never been sampled."""
        token_ids = delta.new_token_ids
        stop_token = delta.finished and delta.finish_reason == "stop"  # an EOS or stop token id ended it
        if len(token_ids) < 2 or request is None or not request.sampling_params.stop:
            change = detok.add_tokens(token_ids, final=delta.finished, stop_token=stop_token)
            delta.new_text = change.new_text
            return change
        text = ""
        for index, token_id in enumerate(token_ids):
            last = index == len(token_ids) - 1
            change = detok.add_tokens([token_id], final=delta.finished and last, stop_token=stop_token and last)
            text += change.new_text
            if change.stopped:
                del token_ids[index + 1:]
                del delta.new_logprobs[index + 1:]
                break
        delta.new_text = text
        return change
