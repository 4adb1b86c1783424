"""``extra.handover_unshard: auto`` (engine_options.resolve_unshard_handover): FSDP's all-gather hands over under
bf16 at any size and in fp32 up to UNSHARD_HANDOVER_FP32_MAX_BYTES of weights; above, the planner's executor (its
lower memory transient); explicit booleans win; anything else is refused with the values it takes."""

from __future__ import annotations

import pytest

from hybridflow.errors import ConfigError
from hybridflow_fsdp.engine_options import UNSHARD_HANDOVER_FP32_MAX_BYTES, resolve_unshard_handover


def test_unshard_handover_auto_by_precision_and_size() -> None:
    small, large = 77_184 * 4, UNSHARD_HANDOVER_FP32_MAX_BYTES + 4
    assert resolve_unshard_handover("auto", mixed_precision="none", weight_bytes=small) is True
    assert resolve_unshard_handover("auto", mixed_precision="none", weight_bytes=UNSHARD_HANDOVER_FP32_MAX_BYTES)
    assert resolve_unshard_handover("auto", mixed_precision="none", weight_bytes=large) is False
    assert resolve_unshard_handover("auto", mixed_precision="bf16", weight_bytes=large) is True
    assert resolve_unshard_handover(False, mixed_precision="bf16", weight_bytes=small) is False
    assert resolve_unshard_handover(True, mixed_precision="none", weight_bytes=large) is True
    with pytest.raises(ConfigError, match="handover_unshard must be true, false or auto, got 'yes'"):
        resolve_unshard_handover("yes", mixed_precision="none", weight_bytes=small)
