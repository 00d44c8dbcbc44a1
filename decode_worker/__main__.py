"""`python -m decode_worker [flags]`: serve DecodeService until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse

import serving
from decode_worker.server import DecodeWorker
from engine.config import DECODE_ROLES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m decode_worker", description=__doc__)
    parser.add_argument("--role", default=DECODE_ROLES[0].value, choices=[role.value for role in DECODE_ROLES],
                        help="decode: import KV from prefill workers; both: colocated, always prefill locally")
    serving.add_worker_arguments(parser, DECODE_ROLES)
    serving.add_process_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    serving.run(args.role, serving.worker_options(args), DecodeWorker.from_options)


if __name__ == "__main__":
    main()
