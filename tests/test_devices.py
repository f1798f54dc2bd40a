"""Device catalog and seeded tier assignment."""

from __future__ import annotations

from collections import Counter

import pytest

from fedfusion.devices import assign_tiers, load_catalog


def test_builtin_catalog_has_the_three_tiers_with_numbers():
    catalog = load_catalog()
    assert {"phone", "laptop", "desktop"} <= set(catalog)
    assert catalog["phone"].memory_gb < catalog["laptop"].memory_gb < catalog["desktop"].memory_gb
    assert all(d.tflops > 0 and d.train_w > 0 for d in catalog.values())


def test_assignment_follows_the_mix_and_is_reproducible():
    mix = {"phone": 0.5, "laptop": 0.3, "desktop": 0.2}
    tiers = assign_tiers(mix, 10, seed=3)
    assert Counter(tiers) == {"phone": 5, "laptop": 3, "desktop": 2}
    assert tiers == assign_tiers(mix, 10, seed=3)
    assert tiers != assign_tiers(mix, 10, seed=4)
    assert Counter(assign_tiers({"a": 1, "b": 1, "c": 1}, 7, seed=0)).most_common(1)[0][1] == 3


def test_user_catalog_errors_name_the_tier(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("watch:\n  memory_gb: 1\n")
    with pytest.raises(ValueError, match="watch"):
        load_catalog(bad)
