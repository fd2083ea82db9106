"""docs/features.md names, for each feature of the app, the test that would fail without it: each named test
exists (a renamed or deleted test fails here, not silently in the document)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_feature_table_names_exists():
    table = (ROOT / "docs" / "features.md").read_text()
    named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", table)
    assert len(named) >= 20
    for path, name in named:
        source = (ROOT / path).read_text()
        if name:
            assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{path}::{name} is not a test there"
