"""`python -m decode_worker [flags]`: serve DecodeService until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse
import asyncio

from prefill_worker.serving import add_engine_arguments, add_server_arguments, configure_logging, engine_options, serve


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m decode_worker", description=__doc__)
    add_engine_arguments(parser)
    add_server_arguments(parser)
    parser.add_argument("--role", default="decode", choices=("decode", "both"),
                        help="decode: import KV from prefill workers; both: colocated, always prefill locally")
    group = parser.add_argument_group("kv transfer")
    group.add_argument("--transport", default="auto",
                       help="receiver transports: auto (shm and tcp on CPU), tcp, shm, ucx, nccl")
    group.add_argument("--local-prefill-threshold", type=int, default=64,
                       help="prefill locally when fewer prompt tokens than this are not in the prefix cache")
    group.add_argument("--on-transfer-failure", default="fallback", choices=("fallback", "fail"),
                       help="after a failed or timed-out KV transfer: prefill locally, or fail the request")
    group.add_argument("--transfer-timeout-s", type=float, default=60.0,
                       help="longest wait for a remote prefill (queueing, compute and transfer)")
    group.add_argument("--kv-timeout-s", type=float, default=5.0, help="a silent sender fails a transfer after this")
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    from decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from engine import wire
    config = DecodeWorkerConfig(
        model=args.model, role=args.role, engine_options=engine_options(args), transport=args.transport,
        local_prefill_threshold=args.local_prefill_threshold, on_transfer_failure=args.on_transfer_failure,
        transfer_timeout_s=args.transfer_timeout_s, kv_timeout_s=args.kv_timeout_s, host=args.host,
        advertise_host=args.advertise_host)
    worker = DecodeWorker(config)
    await serve(lambda server: wire.services().add_DecodeServiceServicer_to_server(worker.servicer(), server),
                args.host, args.port, args.advertise_host,
                lambda _: f"transport={worker.transport_address} role={worker.role}", worker.close)


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
