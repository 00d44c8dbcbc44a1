"""Sliding-window layers across the P -> D hand-off (engine/kv_cache.py `window_skip_blocks`,
engine/kv_connector.py): a transfer leaves out, per sliding layer, the leading blocks the next
token no longer reads. The decode engine then decodes token-exact (transformers' greedy tokens on
the same tiny Gemma 3: sliding and global layers) on what arrived, received exactly the chunks
the windows need, and never shares a block that lacks some layer's KV through its prefix cache.
"""
import pytest
import torch
import transformers

from engine.kv_cache import window_skip_blocks
from tests.engine.kv_pair import BLOCK, PARAMS, Pair, prompt
from tests.engine.tiny_models import WINDOW, save_family_model


def test_window_skip_blocks_leaves_out_exactly_the_blocks_behind_every_window():
    assert window_skip_blocks((), 38, 4) is None
    # window 8, 38 tokens: the next token (position 38) reads 31..38; blocks 0..6 hold 0..27
    assert window_skip_blocks((8, 0, 8), 38, 4) == [7, 0, 7]
    assert window_skip_blocks((8, 0), 38, 4, first_block=2) == [5, 0]  # the transfer starts at block 2
    assert window_skip_blocks((8, 0), 38, 4, first_block=8) == [0, 0]
    assert window_skip_blocks((1,), 8, 4) == [1]  # the last block always moves
    with pytest.raises(ValueError, match="end before block"):
        window_skip_blocks((8,), 8, 4, first_block=2)
    for num_tokens in range(1, 40):
        for window in (1, 2, 3, 5, 8, 13):
            for block in (1, 2, 4, 16):
                [skip] = window_skip_blocks((window,), num_tokens, block)
                first_read = max(0, num_tokens - window + 1)  # the next token's oldest key
                assert skip * block <= first_read  # nothing it reads is left out...
                last_block = (num_tokens - 1) // block
                assert skip == last_block or (skip + 1) * block > first_read  # ...and all else is


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = save_family_model(tmp_path_factory.mktemp("gemma3"), "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                           dtype=torch.float32).eval()

    def greedy(tokens):
        out = hf.generate(torch.tensor([tokens]), max_new_tokens=PARAMS.max_tokens, min_new_tokens=PARAMS.max_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[0, len(tokens):].tolist()
    return folder, greedy


def _chunks_moved(windows, num_tokens, first_block=0):
    skips = window_skip_blocks(windows, num_tokens, BLOCK, first_block)
    num_blocks = -(-num_tokens // BLOCK) - first_block
    return sum(num_blocks - skip for skip in skips), num_blocks * len(windows)


def test_a_sliding_model_moves_only_the_windows_and_the_decode_side_never_shares_what_lacks_a_layer(gemma3):
    """A decode worker whose cache keeps every layer's blocks (kv_layout uniform)."""
    folder, greedy = gemma3
    pair = Pair(folder, "tcp", decode_options={"kv_layout": "uniform"})
    try:
        windows = pair.decode.runner.transfer_cache.layer_windows
        assert set(windows) == {0, WINDOW}, windows  # global and sliding layers
        chunk_bytes = pair.decode.kv_connector.kv_layers[0][0].numel() * 4  # float32
        decode_blocks = pair.decode.scheduler.block_manager

        # A short prompt (inside the window): every block of every layer moves, and is shared.
        short = prompt(1, 8)
        tokens, finals = pair.generate("short", short)
        assert tokens["short"] == greedy(short)
        assert finals["short:import"].bytes_received == 2 * len(windows) * chunk_bytes
        cached = decode_blocks.num_cached_blocks  # its 2 prompt blocks, and full blocks of its output
        assert cached >= 2

        # The same prompt and 30 tokens more: a prefix hit on the decode side (2 blocks), and of the
        # other 8 blocks the sliding layers get the last 3 only (the next token reads 31..38).
        long = short + prompt(2, 30)
        plan = pair.start("long", long)
        assert plan.num_cached_tokens == 2 * BLOCK
        pair.report("long", pair.run_prefill_to_answer("long"))
        tokens, finals = pair.run_decode()
        assert tokens["long"] == greedy(long)
        moved, every = _chunks_moved(windows, len(long), first_block=2)
        assert moved < every
        assert finals["long:import"].bytes_received == moved * chunk_bytes
        # its imported blocks lack the sliding layers' KV: none joined the decode side's cache
        assert decode_blocks.num_cached_blocks == cached

        # A new prompt past the window, no prefix hit: the same, from block 0; the prefill side
        # (which computed every layer) caches its blocks, the decode side none of them.
        other = prompt(3, 38)
        tokens, finals = pair.generate("other", other)
        assert tokens["other"] == greedy(other)
        moved, _ = _chunks_moved(windows, len(other))
        assert finals["other:import"].bytes_received == moved * chunk_bytes
        assert decode_blocks.num_cached_blocks == cached
        assert pair.prefill.scheduler.block_manager.num_cached_blocks >= len(other) // BLOCK
        assert sum(pair.decode.kv_connector.failures.values()) == 0
        pair.assert_nothing_held()
    finally:
        pair.close()


def test_a_grouped_decode_cache_receives_each_layer_groups_window_and_shares_it(gemma3):
    """A decode worker with a grouped cache (engine/kv_groups.py, the default): one transfer per
    layer group, a sliding group's from its window on, the same chunks as above; it holds only
    those blocks, and every block it received joins its prefix cache (no layer's KV is missing),
    so the same prompt again moves only its last block."""
    folder, greedy = gemma3
    pair = Pair(folder, "tcp")
    try:
        decode_blocks = pair.decode.scheduler.block_manager
        assert type(decode_blocks).__name__ == "GroupedBlockManager"
        windows = pair.decode.runner.transfer_cache.layer_windows
        chunk_bytes = pair.decode.kv_connector.kv_layers[0][0].numel() * 4  # float32
        long = prompt(2, 38)
        plan = pair.start("long", long)
        assert plan.groups and not plan.blocks_to_fill and plan.num_cached_tokens == 0
        # the sliding groups' blocks start at block 7 (position 38 reads 31..38); the full group's at 0
        assert sorted(len(group.block_ids) for group in plan.groups) == [3, 3, 3, 10]
        pair.report("long", pair.run_prefill_to_answer("long"))
        tokens, finals = pair.run_decode()
        assert tokens["long"] == greedy(long)
        moved, every = _chunks_moved(windows, len(long))
        assert finals["long:import"].bytes_received == moved * chunk_bytes and moved < every

        again = pair.start("again", long)
        assert again.num_cached_tokens == 36  # every full block, with each group's window
        assert sorted(len(group.block_ids) for group in again.groups) == [1, 1, 1, 1]
        pair.report("again", pair.run_prefill_to_answer("again"))
        tokens, finals = pair.run_decode()
        assert tokens["again"] == greedy(long)
        assert finals["again:import"].bytes_received == len(windows) * chunk_bytes
        assert sum(pair.decode.kv_connector.failures.values()) == 0
        pair.assert_nothing_held()
    finally:
        pair.close()


def test_a_grouped_decode_cache_that_rejects_the_kv_prefills_the_whole_prompt_itself(gemma3):
    """The received bytes fail their checksum (a flipped byte): the decode worker falls back to a
    local prefill, which needs the sliding groups' blocks behind the window it never held; they
    are allocated then, and the tokens are still transformers'."""
    folder, greedy = gemma3
    pair = Pair(folder, "tcp", decode=dict(inject_fault="flip_byte"))
    try:
        long = prompt(4, 38)
        tokens, finals = pair.generate("long", long)
        assert tokens["long"] == greedy(long)
        assert not finals["long:import"].prefilled_remotely
        assert pair.decode.kv_connector.failures["checksum"] == 1
        pair.assert_nothing_held()
    finally:
        pair.close()
