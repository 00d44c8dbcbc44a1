"""A request's prefix-cache keys (engine/block_hash.py's `CacheSalt`): tenant isolation.

`cache_salt` (vLLM's request field) keys every block of the prompt, so requests of different
salts never share a cached block, on any worker, tier or router index: each of those keys
blocks by the chained hash the salt went into. A cache hit cannot tell one tenant what another
sent.

`shared_cache_salt` (pdserve's, chat requests, opt-in) keys the blocks of the prompt's leading
system (or developer) messages instead: tenants that give the same shared salt share the KV of a
common system prompt, and the rest of each prompt, chained on from it, stays under the tenant's
own `cache_salt`. The shared part is what the chat template renders for those messages alone,
as far as it is a prefix of the whole prompt's tokens (templates that render a system message
differently once other turns follow share less, never wrongly).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

from engine.block_hash import CacheSalt
from router import tools

SYSTEM_ROLES = ("system", "developer")


async def request_cache_salt(tokenizer: Any, request: Any, prompt_token_ids: Sequence[int]) -> CacheSalt | None:
    """The block keys of a validated completions or chat request whose (first) prompt is
    `prompt_token_ids`; None without a cache_salt."""
    if request.cache_salt is None:
        return None
    if request.shared_cache_salt is None:  # (only chat requests carry one: protocol.py refuses the rest)
        return CacheSalt(request.cache_salt)
    lead = []
    for message in request.messages:
        if message.get("role") not in SYSTEM_ROLES:
            break
        lead.append(message)
    shared = 0
    if lead:
        ids = await asyncio.to_thread(tokenizer.apply_chat_template, tools.render_messages(lead, request.tool_plan),
                                      False)
        shared = len(os.path.commonprefix([list(ids), list(prompt_token_ids)]))  # (any sequences, not just str)
    return CacheSalt(request.cache_salt, request.shared_cache_salt, shared)

