"""The multi-process launches shared by the distributed tests (see jobs.py)."""

from __future__ import annotations

import pytest

from . import scenarios
from .jobs import ALL
from .launch import launch


@pytest.fixture(scope="session", params=[2, 3], ids=lambda w: f"world{w}")
def world(request) -> tuple[int, dict[str, list[dict]]]:
    """(world size, {job key: every rank's result}) from one launch of every job."""
    per_rank = launch(request.param, scenarios.run_many, [job for _, job in ALL], timeout=240)
    return request.param, {key: [r[i] for r in per_rank] for i, (key, _) in enumerate(ALL)}
