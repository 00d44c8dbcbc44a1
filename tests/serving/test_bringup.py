"""The one bring-up of a worker (serving/bringup.py) without an engine: the shared flags give the
worker mains and `pdserve serve` the same worker options, `KVOptions` agrees with the engine's
`KVConnectorConfig`, `Role` owns the role names, and `start_worker` binds, reports and stops a
worker (a stand-in, built by the builder it is given)."""
import dataclasses
import socket

import pytest

import kvtransfer
import serving
from decode_worker.__main__ import parse_args as decode_args
from deploy.cli import build_parser, serve_options
from engine.config import DECODE_ROLES, KV_ROLES, ROLES, Role
from engine.kv_hooks import KVConnectorConfig
from prefill_worker.__main__ import parse_args as prefill_args
from serving.bringup import KVOptions, WorkerOptions, start_worker

ENGINE = ["--model", "default", "--seed", "7", "--block-size", "32", "--kv-cache-blocks", "300", "--max-num-seqs", "8",
          "--speculative", "ngram"]
KV_BOTH_SIDES = ["--transport", "tcp", "--kv-timeout-s", "9", "--inject-kv-fault", "flip_byte"]
KV_SENDER = ["--export-lease-s", "120", "--no-layerwise-push", "--hold-kv-send-s", "0.5"]
KV_RECEIVER = ["--local-prefill-threshold", "0", "--on-transfer-failure", "fail", "--transfer-timeout-s", "90"]
SENDER_FIELDS = ("lease_s", "layerwise", "hold_send_s")
RECEIVER_FIELDS = ("local_prefill_threshold", "on_transfer_failure", "transfer_timeout_s")


def test_kv_options_are_the_connectors_fields_with_its_defaults_and_choices():
    assert KVOptions().connector_config() == KVConnectorConfig()
    assert KVOptions().kv_timeout_s == kvtransfer.TransferConfig.timeout_s
    connector = {f.name for f in dataclasses.fields(KVConnectorConfig)}
    options = {f.name for f in dataclasses.fields(KVOptions)} - {"transport", "kv_timeout_s"}
    # (no flag sets the layer group size; the MAC key comes from the cluster secret)
    assert options == connector - {"layer_group_size", "mac_key"}
    assert set(serving.KV_FLAGS) == options | {"transport", "kv_timeout_s"}


def test_the_worker_mains_and_pdserve_serve_give_a_worker_the_same_options():
    flags = [*ENGINE, *KV_BOTH_SIDES, "--device", "cpu"]
    by_main = {Role.PREFILL: serving.worker_options(prefill_args([*flags, *KV_SENDER])),
               Role.DECODE: serving.worker_options(decode_args([*flags, *KV_RECEIVER]))}
    spec = serve_options(build_parser().parse_args(["serve", *flags, *KV_SENDER, *KV_RECEIVER])).worker_spec(
        {"CPU": 2.0}, started_ray=True)
    for role, main in by_main.items():
        served = spec.worker_options(role, "10.0.0.1")
        assert (served.model, served.engine_options) == (main.model, main.engine_options)
        assert main.engine_options == {"device": "cpu", "seed": 7, "block_size": 32, "num_blocks": 300,
                                       "max_num_seqs": 8, "speculative_method": "ngram"}
        # each main takes its own side's KV flags; pdserve serve gives every worker both sides'
        other = RECEIVER_FIELDS if role is Role.PREFILL else SENDER_FIELDS
        assert served.kv == dataclasses.replace(main.kv, **{name: getattr(served.kv, name) for name in other})
        assert all(getattr(main.kv, name) == getattr(KVOptions(), name) for name in other)
    assert spec.kv == KVOptions(transport="tcp", kv_timeout_s=9.0, inject_fault="flip_byte", lease_s=120.0,
                                layerwise=False, hold_send_s=0.5, local_prefill_threshold=0,
                                on_transfer_failure="fail", transfer_timeout_s=90.0)


def test_each_main_takes_only_its_sides_kv_flags_and_the_decode_main_its_roles():
    with pytest.raises(SystemExit):
        prefill_args(["--on-transfer-failure", "fail"])
    with pytest.raises(SystemExit):
        decode_args(["--export-lease-s", "5"])
    assert decode_args([]).role == "decode" and decode_args(["--role", "both"]).role == "both"
    with pytest.raises(SystemExit):
        decode_args(["--role", "prefill"])
    with pytest.raises(ValueError, match="--kv-timeout-s must be > 0, got 0.0"):
        serving.worker_options(decode_args(["--kv-timeout-s", "0"]))
    with pytest.raises(ValueError, match="--export-lease-s must be > 0, got 0.0"):
        KVOptions(lease_s=0.0).check()


def test_the_role_enum_owns_the_names_pools_and_kv_sides():
    assert ROLES == ("prefill", "decode", "both") and DECODE_ROLES == ("decode", "both")
    assert KV_ROLES == ("prefill", "decode")
    assert [role.pool for role in Role] == ["prefill", "decode", "colocated"]
    assert [(role.sends_kv, role.imports_kv) for role in Role] == [(True, False), (False, True), (False, False)]
    assert Role.parse("both") is Role.BOTH and f"{Role.BOTH}" == "both" and {"both": 1}[Role.BOTH] == 1
    with pytest.raises(ValueError, match="role must be one of prefill, decode, both, got 'colocated'"):
        Role.parse("colocated")


class StandIn:
    """A `serving.Worker` without an engine."""

    def __init__(self, role, options):
        self.role, self.options = role, options
        self.transport_address = "tcp://127.0.0.1:9" if role.imports_kv else ""
        self.closed = False

    def add_to_server(self, server):
        pass

    def hand_over(self):
        return 0

    def kv_settings(self):
        return dataclasses.asdict(self.options.kv)

    async def close(self):
        self.closed = True


async def test_start_worker_builds_binds_reports_and_stops():
    built = []

    def build(role, options):
        built.append(StandIn(role, options))
        return built[-1]
    running = await start_worker("decode", WorkerOptions(host="127.0.0.1", advertise_host="10.0.0.1"), build)
    try:
        assert built[0].role is Role.DECODE and running.worker is built[0]
        host, port = running.grpc_address.rsplit(":", 1)
        assert host == "10.0.0.1" and int(port) > 0
        assert running.ready_line() == f"READY grpc=10.0.0.1:{port} transport=tcp://127.0.0.1:9 role=decode"
    finally:
        await running.stop(grace_s=0)
    assert built[0].closed


async def test_a_worker_that_cannot_listen_is_closed_and_the_start_fails():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        built = []
        with pytest.raises(RuntimeError, match=f"the prefill worker cannot listen on 127.0.0.1:{port}"):
            await start_worker(Role.PREFILL, WorkerOptions(host="127.0.0.1", port=port),
                               lambda role, options: built.append(StandIn(role, options)) or built[-1])
    assert built[0].closed
