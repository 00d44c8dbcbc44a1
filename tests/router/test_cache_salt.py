"""Tenant isolation in the router (router/cache_salt.py): what a request's cache_salt and
shared_cache_salt send to the workers, and that the routing index never matches one tenant's
prompt by another's blocks. (The workers' caches: tests/engine/test_block_manager.py; through
real workers: tests/router/test_e2e_workers.py.)"""
import httpx

from engine.block_hash import CacheSalt, hash_full_blocks
from tests.router.harness import BLOCK_SIZE, reply_script

SYSTEM = ("You are the support assistant of a company. Answer briefly, politely, and only about the "
          "company's products. " * 4)


def chat(router, salt=None, shared=None, question="Where is my order?"):
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": question}]}
    if salt is not None:
        body["cache_salt"] = salt
    if shared is not None:
        body["shared_cache_salt"] = shared
    return httpx.post(router.url + "/v1/chat/completions", json=body)


def prefill_decisions(router) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics").text
    return {line.split('reason="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("pdserve:routing_decisions_total") and 'role="prefill"' in line}


def test_the_shared_salt_keys_the_system_messages_and_the_salt_the_rest(router, decode, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    assert chat(router, "tenant-1", "org").status_code == 200
    sent = decode.requests[-1]
    system_ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], False)
    assert list(sent.prompt_token_ids[:len(system_ids)]) == system_ids
    assert (sent.cache_salt, sent.shared_cache_salt, sent.shared_salt_tokens) == ("tenant-1", "org", len(system_ids))
    assert chat(router, "tenant-1").status_code == 200
    assert (decode.requests[-1].cache_salt, decode.requests[-1].shared_salt_tokens) == ("tenant-1", 0)


def test_one_tenants_blocks_never_attract_anothers_prompt(router, decode, tokenizer):
    """Prefix affinity follows a tenant's own earlier prompt, never another tenant's same one;
    tenants sharing a salt for the system prompt are routed by those shared blocks."""
    decode.script = reply_script(tokenizer, "ok")
    assert chat(router, "tenant-1").status_code == 200
    before = prefill_decisions(router).get("prefix_affinity", 0)
    assert chat(router, "tenant-2").status_code == 200  # the same prompt, another tenant
    assert prefill_decisions(router).get("prefix_affinity", 0) == before
    assert chat(router, "tenant-1", question="And my invoice?").status_code == 200
    assert prefill_decisions(router)["prefix_affinity"] == before + 1

    assert chat(router, "tenant-3", "org").status_code == 200
    first = decode.requests[-1].prefill_address
    assert chat(router, "tenant-4", "org", question="Do you ship abroad?").status_code == 200
    assert decode.requests[-1].prefill_address == first
    assert prefill_decisions(router)["prefix_affinity"] == before + 2


def test_the_workers_hashes_of_a_shared_salt_match_the_routers():
    salt = CacheSalt("tenant-1", "org", 2 * BLOCK_SIZE + 3)
    tokens = list(range(5 * BLOCK_SIZE))
    hashes = hash_full_blocks(tokens, BLOCK_SIZE, salt)
    assert hashes[:2] == hash_full_blocks(tokens, BLOCK_SIZE, "org")[:2]
    assert hashes[2:] != hash_full_blocks(tokens, BLOCK_SIZE, CacheSalt("tenant-2", "org", 2 * BLOCK_SIZE + 3))[2:]


def test_a_shared_salt_needs_a_salt_and_a_chat_request(router):
    response = chat(router, None, "org")
    assert response.status_code == 400 and response.json()["error"]["param"] == "shared_cache_salt"
    response = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                                "cache_salt": "t", "shared_cache_salt": "org"})
    assert response.status_code == 400 and "chat requests" in response.json()["error"]["message"]
