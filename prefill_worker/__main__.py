"""`python -m prefill_worker [flags]`: serve PrefillService until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse

import serving
from engine.kv_connector import KVConnectorConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker", description=__doc__)
    serving.add_engine_arguments(parser)
    serving.add_server_arguments(parser)
    serving.add_kv_arguments(parser, "sender")
    group = parser.add_argument_group("kv push")
    group.add_argument("--export-lease-s", type=float, default=KVConnectorConfig.lease_s,
                       help="longest time blocks stay pinned for a send (s; default: %(default)s)")
    group.add_argument("--no-layerwise-push", action="store_true",
                       help="push a prompt's KV after its whole prefill instead of layer group by layer group")
    group.add_argument("--hold-kv-send-s", type=float, default=KVConnectorConfig.hold_send_s,
                       help="testing only: delay every KV send")
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    from prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    connector = KVConnectorConfig(lease_s=args.export_lease_s, layerwise=not args.no_layerwise_push,
                                  hold_send_s=args.hold_kv_send_s, inject_fault=args.inject_kv_fault)
    config = PrefillWorkerConfig(model=args.model, engine_options=serving.engine_options(args), transport=args.transport,
                                 kv_timeout_s=args.kv_timeout_s, connector=connector)
    worker = PrefillWorker(config)
    await serving.serve(worker.add_to_server, args.host, args.port, args.advertise_host,
                        lambda _: f"transport= role={worker.role}", worker.close)


def main(argv=None) -> None:
    serving.run(parse_args(argv), _main)


if __name__ == "__main__":
    main()
