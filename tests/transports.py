"""Tests parametrized by kvtransfer transport: every transport is a case, and one unavailable in
this process (ucxx not installed, say) is skipped with the reason rather than left out."""
from __future__ import annotations

from typing import Iterable

import pytest

from kvtransfer import TRANSPORT_NAMES, transport_unavailable_reason


def transport_param(name: str):
    """`name` as a pytest param; a variant such as "shm-cma" takes its transport's availability."""
    reason = transport_unavailable_reason(name.split("-")[0])
    return pytest.param(name, marks=pytest.mark.skip(reason=reason)) if reason else name


def transport_params(names: Iterable[str] = TRANSPORT_NAMES) -> list:
    return [transport_param(name) for name in names]
