"""pipeshard.shard.serving: a forced export cannot take an export folder a fleet process holds."""

from __future__ import annotations

import pytest

from pipeshard.errors import FailedPrecondition
from pipeshard.shard.serving import hold_serving_lock, not_served


def test_a_served_export_cannot_be_taken_until_its_holders_are_gone(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    holders = [hold_serving_lock(export), hold_serving_lock(export)]  # a stage and the coordinator
    for holder in holders:
        with pytest.raises(FailedPrecondition, match="served by a running fleet"), not_served(export):
            pass
        holder.close()
    with not_served(export):
        pass
    with not_served(tmp_path / "missing"):  # nothing there yet: nothing to protect
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # and nothing written
