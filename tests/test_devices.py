"""Device catalog and seeded tier assignment."""

from __future__ import annotations

from collections import Counter
from importlib import resources
from pathlib import Path

import pytest
import yaml

from fedfusion.devices.catalog import assign_tiers, catalog_rows, load_catalog


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


def test_a_client_answers_its_tier_from_the_population_drawn_once_per_process():
    """A QUERY round asks every node: the client draws the population's tiers once, not once per query."""
    from fedfusion.client_app import population_tiers

    population = (("phone", 0.5), ("laptop", 0.3), ("desktop", 0.2)), 50, 7
    population_tiers.cache_clear()
    assert population_tiers(*population) == tuple(assign_tiers({"phone": 0.5, "laptop": 0.3, "desktop": 0.2}, 50, 7))
    population_tiers(*population)
    assert population_tiers.cache_info().hits == 1 and population_tiers.cache_info().misses == 1


def test_user_catalog_errors_name_the_tier(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("watch:\n  memory_gb: 1\n")
    with pytest.raises(ValueError, match="watch"):
        load_catalog(bad)


EDGE = ("phone", "phone-lowend", "phone-apple", "laptop", "laptop-x86")
CLOUD = ("cloud-a5000", "cloud-a100", "cloud-h100")


def test_builtin_catalog_has_edge_and_cloud_tiers_with_sources():
    catalog = load_catalog()
    assert set(EDGE + CLOUD + ("desktop",)) <= set(catalog)
    for d in catalog.values():
        assert d.sources and d.zone and d.lifetime_years > 0 and d.embodied_kg > 0
        assert (d.battery_wh is None) == (d.name in CLOUD + ("desktop",))
    laptop, phone = catalog["laptop"], catalog["phone"]
    assert 30 <= laptop.train_w <= 40 and laptop.embodied_kg == 300 and laptop.lifetime_years == 4
    assert phone.lifetime_years == 3 and phone.up_mbps == phone.down_mbps == 80 and phone.radio_w == 0.5
    assert "anchors.md" in laptop.sources and "assumed" in catalog["cloud-h100"].sources
    assert catalog["cloud-a5000"].tflops < catalog["cloud-a100"].tflops < catalog["cloud-h100"].tflops
    assert catalog["phone-lowend"].memory_gb < phone.memory_gb


def write_tier(tmp_path, drop: str = "", **changes) -> Path:
    """A one-tier catalog named ``watch``: the built-in phone's fields with ``changes``, less ``drop``."""
    raw = yaml.safe_load(resources.files("fedfusion.catalog").joinpath("devices.yaml").read_text())["phone"]
    raw.update(changes)
    raw.pop(drop, None)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"watch": raw}))
    return path


@pytest.mark.parametrize("drop, changes, field", [
    ("idle_w", {}, "idle_w"),
    ("battery_wh", {}, "battery_wh"),
    ("", {"tflops": 0}, "tflops"),
    ("", {"embodied_kg": -1.0}, "embodied_kg"),
    ("", {"radio_w": True}, "radio_w"),
    ("", {"up_mbps": "fast"}, "up_mbps"),
    ("", {"battery_wh": 0}, "battery_wh"),
    ("", {"zone": ""}, "zone"),
    ("", {"colour": "red"}, "colour"),
    ("", {"bfloat16": "yes"}, "bfloat16"),
])
def test_user_catalog_errors_name_the_tier_and_field(tmp_path, drop, changes, field):
    with pytest.raises(ValueError, match=f"'watch'.*{field}"):
        load_catalog(write_tier(tmp_path, drop, **changes))


def test_user_catalog_types_fields_and_allows_mains_devices(tmp_path):
    watch = load_catalog(write_tier(tmp_path, memory_gb=1, zone="FRA"))["watch"]
    assert watch.memory_gb == 1.0 and isinstance(watch.memory_gb, float) and watch.zone == "FRA"
    mains = load_catalog(write_tier(tmp_path, battery_wh=None))["watch"]
    assert mains.battery_wh is None
    assert load_catalog(write_tier(tmp_path, drop="bfloat16"))["watch"].bfloat16 is False  # unsaid: float32 only
    assert load_catalog(write_tier(tmp_path, bfloat16=True))["watch"].bfloat16 is True


def test_only_tiers_with_bfloat16_arithmetic_say_so_with_a_source():
    catalog = load_catalog()
    assert [t for t, d in catalog.items() if not d.bfloat16] == ["phone", "phone-lowend", "laptop-x86"]
    assert all("bfloat16:" in d.sources for d in catalog.values())


def test_catalog_rows_one_per_tier_in_order():
    catalog = load_catalog()
    rows = catalog_rows(catalog)
    assert [r["name"] for r in rows] == list(catalog)
    assert set(rows[0]) == {"name", "description", "memory_gb", "tflops", "train_w", "idle_w", "battery_wh",
                            "up_mbps", "down_mbps", "embodied_kg", "lifetime_years", "zone"}
    laptop = next(r for r in rows if r["name"] == "laptop")
    assert laptop["embodied_kg"] == 300 and laptop["zone"] == catalog["laptop"].zone
