"""`python -m decode_worker [flags]`: serve DecodeService until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse

import serving
from engine.config import DECODE_ROLES
from engine.kv_connector import ON_TRANSFER_FAILURE, KVConnectorConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m decode_worker", description=__doc__)
    serving.add_engine_arguments(parser)
    serving.add_server_arguments(parser)
    parser.add_argument("--role", default=DECODE_ROLES[0], choices=DECODE_ROLES,
                        help="decode: import KV from prefill workers; both: colocated, always prefill locally")
    serving.add_kv_arguments(parser, "receiver")
    group = parser.add_argument_group("remote prefill")
    group.add_argument("--local-prefill-threshold", type=int, default=KVConnectorConfig.local_prefill_threshold,
                       help="prefill locally when fewer prompt tokens than this are not in the prefix cache "
                            "(default: %(default)s)")
    group.add_argument("--on-transfer-failure", default=KVConnectorConfig.on_transfer_failure,
                       choices=ON_TRANSFER_FAILURE,
                       help="after a failed, timed-out or unverifiable KV transfer: prefill locally, or fail the request")
    group.add_argument("--transfer-timeout-s", type=float, default=KVConnectorConfig.transfer_timeout_s,
                       help="longest wait for a remote prefill's progress: its first KV (queue and first "
                            "chunk), then more KV, then its answer (s; default: %(default)s)")
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    from decode_worker.server import DecodeWorker, DecodeWorkerConfig
    connector = KVConnectorConfig(transfer_timeout_s=args.transfer_timeout_s, inject_fault=args.inject_kv_fault,
                                  local_prefill_threshold=args.local_prefill_threshold,
                                  on_transfer_failure=args.on_transfer_failure)
    config = DecodeWorkerConfig(model=args.model, role=args.role, engine_options=serving.engine_options(args),
                                transport=args.transport, kv_timeout_s=args.kv_timeout_s, connector=connector,
                                host=args.host, advertise_host=args.advertise_host)
    worker = DecodeWorker(config)
    await serving.serve(worker.add_to_server, args.host, args.port, args.advertise_host,
                        lambda _: f"transport={worker.transport_address} role={worker.role}", worker.close)


def main(argv=None) -> None:
    serving.run(parse_args(argv), _main)


if __name__ == "__main__":
    main()
