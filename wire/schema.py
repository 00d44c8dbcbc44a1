"""The gRPC wire schema, loaded at run time from `wire/proto/pdserve.proto`, and the channel options.

There is no generated code in the tree, and no Python package named `proto` (`ray[default]`
pulls in `proto-plus`, whose import name is `proto`; a package of ours by that name would shadow
it or be shadowed): `grpc.protos_and_services` compiles the one `.proto` on first use. Router,
workers and deploy import this module, so they always agree with the schema file. The `.proto` is
package data of `wire` (pyproject's package-data), found through `importlib.resources`, so an
installed wheel has it too; its folder, which holds nothing else, goes on sys.path for grpc_tools.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.resources
from pathlib import Path
from typing import Any

from engine.block_hash import CacheSalt
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

PROTO_FILE = "pdserve.proto"
PROTO_FOLDER = "proto"  # inside the `wire` package: wire/proto/pdserve.proto
# Every gRPC server and channel of pdserve: a long prompt's token ids exceed gRPC's 4 MiB default.
GRPC_OPTIONS = (("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20))


_resources = contextlib.ExitStack()  # keeps an extracted copy (a zipped install) for the process's life


@functools.lru_cache(maxsize=1)
def proto_dir() -> Path:
    """The folder holding pdserve.proto: in the package, or a temporary copy where the package is
    not a plain folder (as_file extracts it)."""
    resource = importlib.resources.files("wire") / PROTO_FOLDER / PROTO_FILE
    if not resource.is_file():
        raise RuntimeError(f"wire schema {resource} is missing from this installation (package data of `wire`)")
    return Path(_resources.enter_context(importlib.resources.as_file(resource))).parent


@functools.lru_cache(maxsize=1)
def load():
    """Returns (messages module, services module) for pdserve.proto."""
    import sys

    import grpc

    folder = str(proto_dir())
    if folder not in sys.path:
        sys.path.append(folder)  # grpc_tools resolves the .proto through sys.path
    return grpc.protos_and_services(PROTO_FILE)


def messages():
    return load()[0]


def services():
    return load()[1]


def sampling_to_wire(params: SamplingParams) -> Any:
    """The schema's SamplingParams (stop strings stay with the router, which detokenizes)."""
    pb = messages()
    message = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos, logit_bias=params.logit_bias, min_tokens=params.min_tokens,
        no_speculation=not params.speculative)
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    constraint = params.structured_output
    if constraint is not None:
        message.structured_output.CopyFrom(pb.StructuredOutput(kind=constraint.kind, spec=constraint.spec,
                                                               choices=list(constraint.choices)))
    return message


def sampling_from_wire(message: Any) -> SamplingParams:
    """Every field is taken as sent (the router fills them all); out-of-range values and
    constraints that do not parse raise the engine's ValueError, which the servers return as
    INVALID_ARGUMENT."""
    constraint = None
    if message.HasField("structured_output"):
        wired = message.structured_output
        constraint = StructuredOutput(wired.kind, wired.spec, tuple(wired.choices))
    return SamplingParams(
        max_tokens=int(message.max_tokens), temperature=float(message.temperature), top_p=float(message.top_p),
        top_k=int(message.top_k), min_p=float(message.min_p), presence_penalty=float(message.presence_penalty),
        frequency_penalty=float(message.frequency_penalty),
        repetition_penalty=float(message.repetition_penalty),
        seed=int(message.seed) if message.HasField("seed") else None,
        stop_token_ids=[int(t) for t in message.stop_token_ids], ignore_eos=bool(message.ignore_eos),
        logprobs=int(message.logprobs) if message.HasField("logprobs") else None,
        prompt_logprobs=int(message.prompt_logprobs) if message.HasField("prompt_logprobs") else None,
        structured_output=constraint, logit_bias={int(t): float(b) for t, b in message.logit_bias.items()},
        min_tokens=int(message.min_tokens), speculative=not message.no_speculation)


def cache_salt_to_wire(salt: str | CacheSalt | None) -> dict[str, Any]:
    """A request's block keys (engine/block_hash.py) as GenerateRequest / PrefillRequest fields."""
    if not isinstance(salt, CacheSalt):
        return {"cache_salt": salt or ""}
    return {"cache_salt": salt.own or "", "shared_cache_salt": salt.shared or "",
            "shared_salt_tokens": salt.shared_tokens}


def cache_salt_from_wire(message: Any) -> str | CacheSalt | None:
    """The block keys a GenerateRequest or PrefillRequest names (cache_salt_to_wire's inverse)."""
    if not message.shared_salt_tokens:
        return message.cache_salt or None
    return CacheSalt(message.cache_salt or None, message.shared_cache_salt, message.shared_salt_tokens)
