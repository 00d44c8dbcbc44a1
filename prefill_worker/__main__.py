"""`python -m prefill_worker [flags]`: serve PrefillService until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse
import asyncio

from prefill_worker.serving import add_engine_arguments, add_server_arguments, configure_logging, engine_options, serve


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker", description=__doc__)
    add_engine_arguments(parser)
    add_server_arguments(parser)
    group = parser.add_argument_group("kv transfer")
    group.add_argument("--transport", default="auto", help="sender transports: auto (what the receiver offers), "
                                                           "tcp, shm, ucx, nccl")
    group.add_argument("--kv-timeout-s", type=float, default=5.0, help="a silent receiver fails a transfer after this")
    group.add_argument("--export-lease-s", type=float, default=60.0, help="longest time blocks stay pinned for a send")
    group.add_argument("--hold-kv-send-s", type=float, default=0.0, help="testing only: delay every KV send")
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    from engine import wire
    from prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    config = PrefillWorkerConfig(model=args.model, engine_options=engine_options(args), transport=args.transport,
                                 kv_timeout_s=args.kv_timeout_s, export_lease_s=args.export_lease_s,
                                 hold_kv_send_s=args.hold_kv_send_s)
    worker = PrefillWorker(config)

    async def stop() -> None:
        worker.close()

    await serve(lambda server: wire.services().add_PrefillServiceServicer_to_server(worker.servicer(), server),
                args.host, args.port, args.advertise_host, lambda _: "transport= role=prefill", stop)


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
