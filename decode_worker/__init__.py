"""The decode service: an engine in decode (or colocated `both`) role behind gRPC, importing KV
from prefill workers and streaming tokens. Start with `python -m decode_worker` (see README.md)."""
