"""Test helper: drain an `AsyncEngine` stream."""
from __future__ import annotations


async def collect_tokens(engine, prompt, params) -> list[int]:
    """Every token id the engine streams for one request, in order."""
    tokens: list[int] = []
    async for delta in engine.generate(prompt, params):
        tokens.extend(delta.new_token_ids)
    return tokens
