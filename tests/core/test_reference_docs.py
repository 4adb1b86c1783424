"""docs/reference/ says what the code says: the config-key and hook pages are regenerated from the schema and the
hookspecs and must match what is committed (a key added without rerunning scripts/gen_reference.py fails here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_match_the_code() -> None:
    script = _script()
    assert script.main(["--check"]) == 0, "docs/reference is stale: run python scripts/gen_reference.py"
    config = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    # every top-level section of the schema is there, nested keys spelled as users type them
    for key in ("`actor.optim.lr`", "`rollout.multi_turn.tool_options`", "`resource_pools.<name>.devices_per_node`",
                "`trainer.total_steps`", "`reward.endpoint`"):
        assert key in config, key
    hooks = (ROOT / "docs" / "reference" / "hooks.md").read_text(encoding="utf-8")
    assert "## `hybridflow_register_rollout_engines`" in hooks and "## `hybridflow_register_tools`" in hooks


def test_a_stale_page_is_reported(tmp_path: Path) -> None:
    script = _script()
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "docs" / "reference" / "config.md").write_text("old\n")
    script.ROOT = tmp_path
    assert script.main(["--check"]) == 1
    assert script.main([]) == 0 and script.main(["--check"]) == 0  # writing brings them up to date
