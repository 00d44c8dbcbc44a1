"""`python -m prefill_worker [flags]`: serve PrefillService until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse

import serving
from engine.config import Role
from prefill_worker.server import PrefillWorker


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker", description=__doc__)
    serving.add_worker_arguments(parser, [Role.PREFILL])
    serving.add_process_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    serving.run(Role.PREFILL, serving.worker_options(parse_args(argv)), PrefillWorker.from_options)


if __name__ == "__main__":
    main()
