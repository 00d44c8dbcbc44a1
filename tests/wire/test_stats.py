"""A worker's Stats across the wire (wire/stats.py): the engine's snapshot in, the typed
`WorkerStats` the router and the controller read out."""
import pickle
from dataclasses import fields

from engine.step_types import SchedulerStats
from wire.schema import messages
from wire.stats import WorkerStats, worker_stats_from_wire, worker_stats_to_wire


def test_every_field_of_the_schema_is_read_and_nothing_else():
    schema = {f.name for f in messages().WorkerStats.DESCRIPTOR.fields}
    assert {f.name for f in fields(WorkerStats)} == schema


def test_round_trip_from_the_engines_snapshot():
    snapshot = SchedulerStats(running=2, waiting=1, kv_blocks_total=64, kv_blocks_free=40, kv_blocks_cached=5,
                              prefix_cache_queries=100, prefix_cache_hits=25, num_preemptions=3,
                              prompt_tokens_computed=900, decode_tokens=70, waiting_for_kv=4, host_cache_slots=8,
                              host_cache_used=2, host_cache_hits=16, spec_drafts=10, spec_draft_tokens=40,
                              spec_accepted_tokens=30, prefill_chunk_tokens=512,
                              step_times={"decode": ([1, 2, 0], 0.5), "prefill": ([0, 0, 1], 2.0)},
                              kv_transfer_failures={"checksum": 2})
    message = worker_stats_to_wire("decode", snapshot, 300, 16, kv_bytes_received=4096, rss_bytes=7, weight_bytes=5)
    stats = worker_stats_from_wire(message)
    assert stats == WorkerStats(
        role="decode", running=2, waiting=5, kv_blocks_total=64, kv_blocks_free=40, kv_blocks_cached=5,
        prefix_cache_queries=100, prefix_cache_hits=25, prefill_tokens_queued=300, num_preemptions=3,
        kv_bytes_received=4096, prompt_tokens_computed=900, decode_tokens=70, block_size=16,
        host_cache_blocks_total=8, host_cache_blocks_used=2, host_cache_hits=16, kv_transfer_failures={"checksum": 2},
        rss_bytes=7, weight_bytes=5, spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=30,
        prefill_chunk_tokens=512, step_times={"decode": ((1, 2, 0), 0.5), "prefill": ((0, 0, 1), 2.0)})
    assert (stats.prefix_cache_hit_rate, stats.spec_acceptance_rate) == (0.25, 0.75)
    assert pickle.loads(pickle.dumps(stats)) == stats  # how a Ray actor would hand it on


def test_an_empty_answer_reads_as_zeros():
    stats = worker_stats_from_wire(messages().WorkerStats())
    assert stats == WorkerStats()
    assert stats.prefix_cache_hit_rate is None and stats.spec_acceptance_rate is None
