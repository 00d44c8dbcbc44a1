"""Time to first token: disaggregated with layer-wise push, disaggregated with push-after-prefill,
and colocated, in one run (issue: the transfer must hide behind the prefill).

    python benchmarks/ttft_disagg.py --lengths 512 2048 4096 --transports shm tcp --repeats 5 \\
        --json benchmarks/results/ttft_disagg_cpu.json

Starts real worker processes on 127.0.0.1: one colocated worker (`--role both`), two prefill
workers (layer-wise push, and `--no-layerwise-push`) and one decode worker per transport. Each
measurement is one Generate call with `max_tokens=1` on a fresh random prompt (no prefix-cache
hit anywhere), timed from the call to its first token chunk; the systems take turns within each
repeat, so a slow phase of the machine hits them all. Reports the median per system and length,
and its ratio to colocated.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import wire  # noqa: E402
from wire.cluster_auth import ClusterAuth, secret_file_from_environment  # noqa: E402
from engine.cpu_kernels import cpu_model  # noqa: E402

ENGINE = ["--model", "default", "--host", "127.0.0.1", "--port", "0", "--num-blocks", "800",
          "--log-level", "WARNING"]


class Worker:
    """One `python -m {kind}_worker` process; `grpc` and `transport` from its ready line."""

    def __init__(self, kind: str, args: list[str], threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        self.process = subprocess.Popen([sys.executable, "-m", f"{kind}_worker", *ENGINE, *args], cwd=REPO, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.grpc = self.transport = ""

    def wait_ready(self) -> "Worker":
        for line in self.process.stdout:
            if line.startswith("READY "):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                self.grpc, self.transport = fields["grpc"], fields["transport"]
                return self
        raise RuntimeError(f"{self.process.args} exited with {self.process.wait()}")

    def stub(self):
        """A DecodeService stub on this worker, secured as the worker is: it inherits this
        environment, so $PDSERVE_CLUSTER_SECRET_FILE, when set, is its cluster secret too."""
        auth = ClusterAuth.from_file(secret_file_from_environment())
        return wire.services().DecodeServiceStub(auth.channel(self.grpc, options=wire.GRPC_OPTIONS, aio=False))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def ttft(decode: Worker, prompt: list[int], prefill: Worker | None, request_id: str) -> float:
    pb = wire.messages()
    sampling = pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                                 ignore_eos=True)
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                 prefill_address=prefill.grpc if prefill else "")
    stub = decode.stub()
    start = time.perf_counter()
    elapsed, remote = None, False
    for chunk in stub.Generate(request, timeout=600):
        if chunk.token_ids and elapsed is None:
            elapsed = time.perf_counter() - start
        # the chunk that says how the KV arrived: the first token's, or (a first token streamed as
        # the prefill worker answered) a later one
        remote = remote or chunk.prefilled_remotely
    if elapsed is None:
        raise RuntimeError(f"{request_id} returned no token")
    if prefill is not None and not remote:
        raise RuntimeError(f"{request_id} fell back to local prefill: not a disaggregated measurement")
    return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--transports", nargs="+", default=["shm", "tcp"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP threads per worker")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    colocated = Worker("decode", ["--role", "both"], args.threads)
    prefill = {"layerwise": Worker("prefill", [], args.threads),
               "after_prefill": Worker("prefill", ["--no-layerwise-push"], args.threads)}
    decodes = {t: Worker("decode", ["--transport", t, "--local-prefill-threshold", "0"], args.threads)
               for t in args.transports}
    workers = [colocated, *prefill.values(), *decodes.values()]
    try:
        for worker in workers:
            worker.wait_ready()
        systems = {"colocated": (colocated, None)}
        for transport, decode in decodes.items():
            for push, worker in prefill.items():
                systems[f"{transport}/{push}"] = (decode, worker)
        rng = random.Random(0)
        for name, (decode, worker) in systems.items():  # warm-up: connections, first-call costs
            ttft(decode, [rng.randrange(100, 40000) for _ in range(64)], worker, f"warm-{name}")
        samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.lengths} for name in systems}
        for repeat in range(args.repeats):
            for length in args.lengths:
                for name, (decode, worker) in systems.items():
                    prompt = [rng.randrange(100, 40000) for _ in range(length)]
                    samples[name][length].append(ttft(decode, prompt, worker, f"{name}-{length}-{repeat}"))
        report = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                  "cpu_model": cpu_model(), "repeats": args.repeats, "threads": args.threads, "results": {}}
        print(f"{'system':<26}" + "".join(f"{n:>16}" for n in args.lengths))
        for name in systems:
            row = {}
            for length in args.lengths:
                median = statistics.median(samples[name][length])
                base = statistics.median(samples["colocated"][length])
                row[str(length)] = {"median_s": median, "vs_colocated": median / base,
                                    "samples_s": samples[name][length]}
            report["results"][name] = row
            print(f"{name:<26}" + "".join(f"{row[str(n)]['median_s']:>9.3f}s {row[str(n)]['vs_colocated']:>4.2f}x"
                                          for n in args.lengths))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    main()
