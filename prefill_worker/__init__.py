"""The prefill service: an engine in prefill role behind gRPC, exporting KV to decode workers.

Start one with `python -m prefill_worker --model default --port 0` (see decode_worker/README.md).
"""
