"""The transport variants a suite runs over, as module-scoped fixtures (import them into the test
module): `variant` ("tcp", "shm", "ucx", "nccl", and "shm-cma": shm with cross-memory reads enabled
on both sides, ring if the OS forbids them; "shm-mapped": the sender's caches in shared memory,
which the receiver maps and copies from), its `transport`, and its TransferConfig `options` on
top of the timeouts."""
from __future__ import annotations

import pytest

from kvtransfer import TRANSPORT_NAMES

from ..transports import transport_params

TRANSPORTS = transport_params([*TRANSPORT_NAMES, "shm-cma", "shm-mapped"])


@pytest.fixture(scope="module", params=TRANSPORTS)
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def transport(variant):
    return variant.split("-")[0]


@pytest.fixture(scope="module")
def options(variant):
    return {"shm_cross_memory_attach": True} if variant == "shm-cma" else {}
