"""A prefill-role and a decode-role engine in one process joined by a real kvtransfer transport,
driven as the two worker servers drive them (tests/engine: the KV connector, tensor parallelism)."""
from __future__ import annotations

import asyncio
import time

import torch

import kvtransfer
from engine.engine import LLMEngine
from engine.kv_hooks import KVConnectorConfig, ProducerReport
from engine.llm import build_engine_config
from engine.model.loader import resolve_model
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.step_types import SampledToken

BLOCK = 4
NUM_BLOCKS = 256
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, role, kv_transport=None, connector=None, **options):
    config = build_engine_config(model_dir, role=role, device="cpu", block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                 attention_backend="torch", max_num_batched_tokens=options.pop("budget", 64),
                                 shared_memory=role == "prefill", **options)
    runner = ModelRunner(config, resolve_model(model_dir))
    return LLMEngine(config, runner=runner, tokenizer=None, kv_transport=kv_transport,
                     kv_connector_config=connector)


def prompt(seed, length):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (length,), generator=generator).tolist()


class Pair:
    """A prefill and a decode engine joined by one transport, stepped on the test's thread."""

    def __init__(self, model_dir, transport, prefill=None, decode=None, decode_options=None, **options):
        """`prefill` / `decode`: KVConnectorConfig fields; `options` / `decode_options`: engine
        options of the prefill / decode engine (e.g. tensor_parallel_size)."""
        self.model_dir, self.transport_name = model_dir, transport
        self.transfer_config = kvtransfer.TransferConfig(timeout_s=2.0)

        def make_receiver(kv_cache, on_end):
            return kvtransfer.create_receiver(transport, kv_cache.layers, self.transfer_config, on_end,
                                              packed=kv_cache.kv_format, layer_windows=kv_cache.layer_windows)

        self.prefill = self.make_prefill(prefill, **options)
        self.decode = make_engine(model_dir, "decode", make_receiver,
                                  KVConnectorConfig(local_prefill_threshold=0, **(decode or {})), **(decode_options or {}))

    def make_prefill(self, connector=None, **options):
        """A prefill engine (a new sender: a new epoch), as a restarted prefill worker has."""
        def make_sender(kv_cache, on_end):
            shared = kvtransfer.SharedMemory(kv_cache.memory_fd, kv_cache.data.data_ptr(),
                                             kv_cache.data.numel() * kv_cache.data.element_size())
            return kvtransfer.create_sender(self.transport_name, kv_cache.layers, self.transfer_config,
                                            shared_memory=shared, on_transfer_end=on_end, packed=kv_cache.kv_format,
                                            layer_windows=kv_cache.layer_windows)
        return make_engine(self.model_dir, "prefill", make_sender, KVConnectorConfig(**(connector or {})), **options)

    def close(self):
        for engine in (self.prefill, self.decode):
            engine.kv_connector.transport.close()
            engine.close()  # tensor-parallel followers

    # ---- the two servers' parts ---------------------------------------------------------

    def start(self, request_id, tokens, params=PARAMS):
        """Decode side: allocate and expect; prefill side: queue with the destination."""
        request = self.decode.make_request(tokens, params, request_id)
        plan = self.decode.add_imported(request)
        assert plan is not None
        destination = plan.destination(self.decode.kv_connector.transport.address, BLOCK)
        self.prefill.add(self.prefill.make_request(tokens, params, request_id, kv_destination=destination),
                         detokenize=False)
        return plan

    def run_prefill(self, until=lambda deltas: any(d.finished for d in deltas), timeout=30.0):
        """Step the prefill engine until `until(deltas so far)`; returns them."""
        deltas = []
        deadline = time.monotonic() + timeout
        while not until(deltas):
            assert time.monotonic() < deadline, f"prefill engine stuck: {deltas}"
            deltas += self.prefill.step()
            if self.prefill.last_step_idle:
                self.prefill.wakeup.wait(0.02)
                self.prefill.wakeup.clear()
        return deltas

    def run_prefill_to_answer(self, request_id, timeout=30.0):
        """Step the prefill engine until the delta its server answers `request_id` with
        (`StreamDelta.answers_prefill`); returns the deltas so far (of every request)."""
        return self.run_prefill(until=lambda deltas: any(d.request_id == request_id and d.answers_prefill
                                                         for d in deltas), timeout=timeout)

    @staticmethod
    def producer_report(deltas):
        """(report, error): what the decode server makes of the PrefillResponse (answered by the
        first delta that `answers_prefill`)."""
        answer = next(d for d in deltas if d.answers_prefill)
        first = next((d for d in deltas if d.new_token_ids), None)
        result = answer.kv_send
        if (answer.finished and answer.finish_reason != "prefill_done") or result is None or result.error:
            return None, f"prefill worker: {answer.error or (result.error if result else 'no KV send')}"
        return ProducerReport(SampledToken(first.new_token_ids[0]), result.epoch, result.checksum,
                              result.block_hashes, answer.num_cached_tokens, result.bytes_sent), None

    def report(self, request_id, deltas):
        """What the decode server hands to the engine from the PrefillResponse (`deltas`: the
        prefill engine's, of any requests)."""
        mine = [d for d in deltas if d.request_id == request_id]
        return self.decode.kv_connector.report_producer(request_id, *self.producer_report(mine))

    def run_decode(self, timeout=30.0):
        tokens, finals = {}, {}
        deadline = time.monotonic() + timeout
        while self.decode.has_unfinished():
            assert time.monotonic() < deadline, "decode engine stuck"
            for delta in self.decode.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.kv_import is not None:
                    finals.setdefault(delta.request_id + ":import", delta.kv_import)
                if delta.finished:
                    finals[delta.request_id] = delta
            if self.decode.last_step_idle:
                self.decode.wakeup.wait(0.02)
                self.decode.wakeup.clear()
        return tokens, finals

    def generate(self, request_id, tokens):
        self.start(request_id, tokens)
        self.report(request_id, self.run_prefill_to_answer(request_id))
        return self.run_decode()

    def run_and_close(self, main):
        """Run the coroutine function `main` (a test that drives an engine through AsyncEngine),
        then check that neither engine holds anything; the pair is closed either way."""
        try:
            asyncio.run(main())
            self.assert_nothing_held()
        finally:
            self.close()

    def assert_nothing_held(self):
        deadline = time.monotonic() + 10
        for engine in (self.prefill, self.decode):
            while engine.has_unfinished():  # e.g. a send that ends at its lease
                assert time.monotonic() < deadline, f"{engine.config.role} engine keeps requests"
                engine.step()
                engine.wakeup.wait(0.02)
                engine.wakeup.clear()
            engine.scheduler.check_integrity()
            bm = engine.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks - bm.num_reserved and not bm.holder_ids(), engine.config.role
