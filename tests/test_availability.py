"""Availability model: seeded, order-free, diurnal, power/network rules and dropouts."""

from __future__ import annotations

import numpy as np
import pytest

from fedfusion.devices.availability import AvailabilityConfig, AvailabilityModel, device_kind
from fedfusion.devices.catalog import load_catalog

H = 3600.0


def mixed(n: int = 3000, seed: int = 0, **config) -> AvailabilityModel:
    kinds = np.random.default_rng(1).choice(["phone", "laptop", "desktop"], n).tolist()
    return AvailabilityModel(kinds, seed=seed, zones=["USA"] * n, config=AvailabilityConfig(**config))


def test_seeded_and_independent_of_call_order():
    a, b = mixed(seed=3), mixed(seed=3)
    late = a.state(7, 40 * H)
    early = a.state(2, 5 * H)
    assert np.array_equal(b.state(2, 5 * H).eligible, early.eligible)  # b never saw round 7
    assert np.array_equal(b.state(7, 40 * H).eligible, late.eligible)
    assert not np.array_equal(mixed(seed=4).state(2, 5 * H).eligible, early.eligible)


def test_subset_query_matches_full_query():
    m = mixed()
    full = m.state(3, 30 * H)
    idx = np.array([5, 17, 2999, 0])
    part = m.state(3, 30 * H, idx)
    for field in ("eligible", "plugged", "online", "in_window"):
        assert np.array_equal(getattr(part, field), getattr(full, field)[idx])
    assert np.allclose(part.battery, full.battery[idx], equal_nan=True)


def test_phones_are_mostly_available_at_night_not_in_the_afternoon():
    n = 4000
    m = AvailabilityModel(["phone"] * n, seed=0, tz_offset_h=np.zeros(n))
    night, afternoon = m.state(1, 24 * H + 3 * H), m.state(2, 24 * H + 15 * H)
    assert night.eligible.mean() > 0.6
    assert afternoon.eligible.mean() < 0.02
    # eligible phones are charging, online, on WiFi
    assert np.all(night.plugged[night.eligible]) and np.all(night.online[night.eligible])


def test_time_zone_shifts_the_window():
    n = 2000
    east = AvailabilityModel(["phone"] * n, seed=0, tz_offset_h=np.full(n, 12.0))
    west = AvailabilityModel(["phone"] * n, seed=0, tz_offset_h=np.zeros(n))
    t = 24 * H + 15 * H  # 15:00 UTC = 03:00 at +12
    assert east.state(1, t).eligible.mean() > 0.6 > west.state(1, t).eligible.mean()


def test_battery_rises_while_charging_and_desktops_have_none():
    m = mixed()
    s0, s1 = m.state(1, 26 * H), m.state(1, 26.5 * H)
    same = s0.plugged & s1.plugged & ~np.isnan(s0.battery) & (s0.window_end_s == s1.window_end_s)
    assert same.sum() > 100
    assert np.all(s1.battery[same] >= s0.battery[same])
    assert np.all((s0.battery[~np.isnan(s0.battery)] >= 0.1) & (s0.battery[~np.isnan(s0.battery)] <= 1.0))
    desktops = m.kind == 2
    assert np.all(np.isnan(s0.battery[desktops])) and np.all(s0.plugged[desktops])


def test_unplugged_laptops_need_battery():
    n = 3000
    m = AvailabilityModel(["laptop"] * n, seed=0, tz_offset_h=np.zeros(n),
                          config=AvailabilityConfig(net_down_prob=0.0))
    s = m.state(1, 24 * H + 23 * H)
    unplugged = s.in_window & ~s.plugged
    assert unplugged.sum() > 100
    assert np.array_equal(s.eligible[unplugged], s.battery[unplugged] >= 0.5)


def test_network_outages_follow_their_probability():
    n = 20000
    m = AvailabilityModel(["desktop"] * n, seed=0, config=AvailabilityConfig(net_down_prob=0.2))
    down = 1 - m.state(4, 0.0).online.mean()
    assert down == pytest.approx(0.2, abs=0.015)


def test_jobs_must_end_inside_the_window():
    n = 3000
    m = AvailabilityModel(["desktop"] * n, seed=0, config=AvailabilityConfig(interrupt_per_h=0.0, net_down_prob=0.0))
    t = 24 * H + 2 * H
    s = m.state(1, t)
    idx = np.flatnonzero(s.eligible)
    left = s.window_end_s[idx] - t
    assert np.all((left > 0) & (left <= 21 * H))
    assert np.array_equal(m.completes(1, t, idx, left - 1.0), np.ones(len(idx), bool))
    assert not m.completes(1, t, idx, left + 1.0).any()
    assert not m.completes(1, t, np.flatnonzero(~s.eligible), 0.0).any()  # ineligible devices never finish


def test_interruptions_drop_long_jobs_more_often():
    n = 20000
    m = AvailabilityModel(["desktop"] * n, seed=0, tz_offset_h=np.zeros(n),
                          config=AvailabilityConfig(interrupt_per_h=0.5, net_down_prob=0.0, start_spread_h=0.0,
                                                    length_spread_h=0.0, daily_jitter_h=0.0))
    t = 18.5 * H  # every window opened at 18:00 and lasts 13 h
    idx = np.arange(n)
    assert m.completes(1, t, idx, 0.0).all()
    assert m.completes(1, t, idx, 2 * H).mean() == pytest.approx(np.exp(-1.0), abs=0.015)


def test_unplugged_laptop_drops_when_the_job_drains_its_battery():
    n = 3000
    m = AvailabilityModel(["laptop"] * n, seed=0, tz_offset_h=np.zeros(n),
                          config=AvailabilityConfig(interrupt_per_h=0.0, net_down_prob=0.0))
    t = 24 * H + 21 * H
    s = m.state(1, t)
    idx = np.flatnonzero(s.eligible & ~s.plugged)
    assert len(idx) > 50
    small = m.completes(1, t, idx, 60.0, energy_j=1.0, battery_wh=60.0)
    huge = m.completes(1, t, idx, 60.0, energy_j=60 * 3600.0, battery_wh=60.0)  # a whole battery
    assert small.mean() > 0.9 and not huge.any()
    plugged = np.flatnonzero(s.eligible & s.plugged)
    assert m.completes(1, t, plugged, 60.0, energy_j=60 * 3600.0, battery_wh=60.0).mean() > 0.9


def test_kinds_from_the_catalog():
    cat = load_catalog()
    assert [device_kind(cat[t]) for t in ("phone", "phone-apple", "laptop", "laptop-x86", "desktop", "cloud-a100")] == [
        "phone", "phone", "laptop", "laptop", "desktop", "desktop"]
    m = AvailabilityModel.for_tiers(["phone", "laptop", "desktop"], cat, seed=0)
    assert m.kind.tolist() == [0, 1, 2]
    assert set(m.tz_offset_h) <= {-8.0, -7.0, -6.0, -5.0}  # the catalog's zone is USA


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown kind 'tablet'"):
        AvailabilityModel(["phone", "tablet"])
    with pytest.raises(ValueError, match="no UTC offsets for zone 'MARS'"):
        AvailabilityModel(["phone"], zones=["MARS"])
    with pytest.raises(ValueError, match="availability.wifi_prob: must be in"):
        AvailabilityConfig(wifi_prob=1.5)
    with pytest.raises(ValueError, match="availability.phone_hours"):
        AvailabilityConfig(phone_hours=30)
    with pytest.raises(ValueError, match="devices: indices must be in"):
        AvailabilityModel(["phone"]).state(1, 0.0, [3])
    with pytest.raises(ValueError, match="duration_s"):
        AvailabilityModel(["phone"]).completes(1, 0.0, [0], -1.0)
    with pytest.raises(ValueError, match="tiers: 'toaster'"):
        AvailabilityModel.for_tiers(["toaster"], load_catalog())
