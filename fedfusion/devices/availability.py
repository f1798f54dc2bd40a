"""When each virtual device may train: a seeded model of diurnal windows, battery, power and network.

Real federations only get a device while it is idle, on power and on an unmetered network (FLASH and
FedScale traces); a device that leaves that state mid-job drops out and its energy is wasted. This
module decides both, for any number of devices at once (numpy arrays, so 100,000 devices cost
milliseconds), as a pure function of (seed, device, day or round): no hidden state, any clock in any
order gives the same answer.

Assumptions (every number is a default of :class:`AvailabilityConfig` unless said otherwise):

- **Clock.** ``clock_s`` counts simulated seconds from midnight UTC of day 0. A device's local time is
  ``clock_s + 3600 * tz_offset_h``. Each device gets an offset from its grid zone
  (:data:`ZONE_UTC_OFFSETS_H`, one of the zone's offsets drawn per device; WORLD spans -10..+10 h).
- **Kinds.** Catalog tiers map to three kinds (:func:`device_kind`): no battery -> ``desktop``;
  battery under 40 Wh -> ``phone``; else ``laptop``.
- **One window a day.** Every device has one eligible window per local day: phones a nightly charging
  window (opens ~22:30, lasts ~7.5 h), laptops an evening/night idle window (~19:00, ~11 h), desktops an
  idle window (~18:00, ~13 h). Per device the opening hour is normal around the kind's mean
  (sd ``start_spread_h``), the length normal (sd ``length_spread_h``, clipped to [2, 20] h); per device
  and day the opening moves by a uniform jitter of +-``daily_jitter_h``. Weekends are not modelled.
- **Phones** need charging + idle + WiFi: they are eligible only inside their charging window (charging,
  idle by assumption at night) and only if they have WiFi where they charge (a per-device draw,
  ``wifi_prob``). Charging devices are assumed to gain charge while training (a 15-20 W charger
  outpaces a 3-6 W training load), so training never drains them.
- **Laptops** are eligible inside their idle window if plugged in (a per device-day draw,
  ``laptop_plugged_prob``) or, unplugged, with battery >= ``min_battery``. An unplugged laptop's job
  drains its battery by the job's joules; it drops out if that would end below ``drop_battery``.
- **Desktops** are on mains: eligible inside their idle window.
- **Battery level.** Per device and day a level is drawn uniform in [0.1, 0.9]. While charging it rises
  linearly from there to full in ``phone_full_charge_h`` / ``laptop_full_charge_h`` hours, capped at 1.
  Desktops report NaN (no battery).
- **Network.** For each (device, round) the network is down with probability ``net_down_prob``; a
  device without network is not eligible that round.
- **Dropouts.** A job of ``d`` seconds started at ``clock_s`` completes only if the device is eligible
  then, the job ends inside the same window, an unplugged laptop keeps enough battery, and the user does
  not take the device back: interruptions arrive at ``interrupt_per_h`` per hour (Poisson), so the job
  survives with probability ``exp(-interrupt_per_h * d / 3600)``, drawn per (device, round).
  Missing the round deadline is the caller's check (compare ``d`` with the deadline).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Sequence

import numpy as np

from fedfusion.devices.catalog import Device

KINDS = ("phone", "laptop", "desktop")
_PHONE, _LAPTOP, _DESKTOP = range(3)
_DAY_S = 86400.0

# UTC offsets (hours) a device of each grid zone may have; one is drawn per device.
ZONE_UTC_OFFSETS_H: dict[str, tuple[float, ...]] = {
    "USA": (-8.0, -7.0, -6.0, -5.0), "GBR": (0.0,), "DEU": (1.0,), "FRA": (1.0,), "IND": (5.5,),
    "CHN": (8.0,), "POL": (1.0,), "SWE": (1.0,), "NOR": (1.0,),
    "WORLD": tuple(float(h) for h in range(-10, 11)),
}

# Independent hash streams, so draws of different quantities never coincide.
_JITTER, _BATTERY, _PLUGGED, _NETWORK, _INTERRUPT = range(1, 6)


@dataclass(frozen=True)
class AvailabilityConfig:
    """Knobs of the availability model (hours are local time); see the module docstring."""

    phone_start_h: float = 22.5
    phone_hours: float = 7.5
    laptop_start_h: float = 19.0
    laptop_hours: float = 11.0
    desktop_start_h: float = 18.0
    desktop_hours: float = 13.0
    start_spread_h: float = 1.5
    length_spread_h: float = 1.0
    daily_jitter_h: float = 0.5
    wifi_prob: float = 0.9
    laptop_plugged_prob: float = 0.6
    min_battery: float = 0.5
    drop_battery: float = 0.2
    phone_full_charge_h: float = 2.0
    laptop_full_charge_h: float = 2.5
    net_down_prob: float = 0.05
    interrupt_per_h: float = 0.05

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"availability.{f.name}: must be a finite number >= 0, got {value!r}")
        for name in ("wifi_prob", "laptop_plugged_prob", "min_battery", "drop_battery", "net_down_prob"):
            if getattr(self, name) > 1:
                raise ValueError(f"availability.{name}: must be in [0, 1], got {getattr(self, name)}")
        for name in ("phone_hours", "laptop_hours", "desktop_hours"):
            if not 2 <= getattr(self, name) <= 20:
                raise ValueError(f"availability.{name}: must be in [2, 20] hours, got {getattr(self, name)}")
        for name in ("phone_full_charge_h", "laptop_full_charge_h"):
            if getattr(self, name) == 0:
                raise ValueError(f"availability.{name}: must be > 0")
        if self.daily_jitter_h > 1:
            raise ValueError(f"availability.daily_jitter_h: must be at most 1 hour, got {self.daily_jitter_h}")

    def to_dict(self) -> dict[str, float]:
        """Plain dict, e.g. for a run's recipe or ledger."""
        return asdict(self)


@dataclass(frozen=True)
class AvailabilityState:
    """Columnar state of some devices at one (round, clock): one entry per device asked about."""

    devices: np.ndarray  # int64 device indices
    eligible: np.ndarray  # bool: may be selected now
    in_window: np.ndarray  # bool: inside its charging/idle window
    plugged: np.ndarray  # bool: on external power (charging phone, plugged laptop, any desktop)
    battery: np.ndarray  # float in [0, 1]; NaN for devices without a battery
    online: np.ndarray  # bool: network up this round (and WiFi for phones)
    window_end_s: np.ndarray  # float: clock second the current window closes; NaN outside a window


def device_kind(device: Device) -> str:
    """The availability kind of a catalog tier: desktop (no battery), phone (< 40 Wh) or laptop."""
    if device.battery_wh is None:
        return "desktop"
    return "phone" if device.battery_wh < 40 else "laptop"


_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _uniform(seed: int, stream: int, a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    """Uniform [0, 1) draws that depend only on (seed, stream, a, b): random access into the randomness."""
    with np.errstate(over="ignore"):
        key = np.array([seed * 1000003 + stream], dtype=np.int64).astype(np.uint64)
        x = _mix(key + np.asarray(a, dtype=np.int64).astype(np.uint64) * _GOLD)
        x = _mix(x + np.asarray(b, dtype=np.int64).astype(np.uint64) * _GOLD)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


class AvailabilityModel:
    """Eligibility of ``len(kinds)`` devices over simulated time, seeded; see the module docstring.

    ``kinds``: each device's kind (phone, laptop, desktop); ``zones``: each device's grid zone (default
    WORLD) from which its UTC offset is drawn, unless ``tz_offset_h`` gives the offsets directly.
    """

    def __init__(
        self, kinds: Sequence[str], seed: int = 0, zones: Sequence[str] | None = None,
        config: AvailabilityConfig | None = None, tz_offset_h: Sequence[float] | None = None,
    ) -> None:
        self.config = config or AvailabilityConfig()
        self.seed = int(seed)
        bad = sorted(set(kinds) - set(KINDS))
        if bad:
            raise ValueError(f"kinds: unknown kind {bad[0]!r}; known kinds: {', '.join(KINDS)}")
        self.kind = np.array([KINDS.index(k) for k in kinds], dtype=np.int8)
        n = len(self.kind)
        rng = np.random.default_rng([self.seed, 0xA7A1])
        c = self.config
        mean_start = np.array([c.phone_start_h, c.laptop_start_h, c.desktop_start_h])[self.kind]
        mean_len = np.array([c.phone_hours, c.laptop_hours, c.desktop_hours])[self.kind]
        self.start_h = np.mod(mean_start + c.start_spread_h * rng.standard_normal(n), 24.0)
        self.length_h = np.clip(mean_len + c.length_spread_h * rng.standard_normal(n), 2.0, 20.0)
        self.wifi = (self.kind != _PHONE) | (rng.random(n) < c.wifi_prob)
        if tz_offset_h is not None:
            self.tz_offset_h = np.asarray(tz_offset_h, dtype=float)
            if self.tz_offset_h.shape != (n,):
                raise ValueError(f"tz_offset_h: expected {n} offsets, got shape {self.tz_offset_h.shape}")
        else:
            zones = ["WORLD"] * n if zones is None else list(zones)
            if len(zones) != n:
                raise ValueError(f"zones: expected {n} zones, got {len(zones)}")
            unknown = sorted(set(zones) - set(ZONE_UTC_OFFSETS_H))
            if unknown:
                raise ValueError(
                    f"zones: no UTC offsets for zone {unknown[0]!r}; known: {', '.join(ZONE_UTC_OFFSETS_H)}")
            pick = rng.random(n)
            self.tz_offset_h = np.empty(n)
            names = np.array(zones, dtype=object)
            for zone in set(zones):
                where = names == zone
                offsets = np.array(ZONE_UTC_OFFSETS_H[zone])
                self.tz_offset_h[where] = offsets[(pick[where] * len(offsets)).astype(int)]

    @classmethod
    def for_tiers(
        cls, tiers: Sequence[str], catalog: dict[str, Device], seed: int = 0,
        zones: Sequence[str] | None = None, config: AvailabilityConfig | None = None,
    ) -> AvailabilityModel:
        """A model for devices given by catalog tier; zones default to each tier's catalog zone."""
        unknown = sorted(set(tiers) - set(catalog))
        if unknown:
            raise ValueError(f"tiers: {unknown[0]!r} is not in the device catalog")
        kinds = [device_kind(catalog[t]) for t in tiers]
        return cls(kinds, seed, zones or [catalog[t].zone for t in tiers], config)

    def __len__(self) -> int:
        return len(self.kind)

    def _index(self, devices: Sequence[int] | np.ndarray | None) -> np.ndarray:
        if devices is None:
            return np.arange(len(self.kind))
        idx = np.asarray(devices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self.kind)):
            raise ValueError(f"devices: indices must be in [0, {len(self.kind)}), got {idx.min()}..{idx.max()}")
        return idx

    def state(self, round: int, clock_s: float, devices: Sequence[int] | np.ndarray | None = None) -> AvailabilityState:
        """Who is eligible in ``round`` at ``clock_s`` (all devices, or those indexed by ``devices``)."""
        if not np.isfinite(clock_s):
            raise ValueError(f"clock_s: must be finite, got {clock_s}")
        c, idx = self.config, self._index(devices)
        kind = self.kind[idx]
        tz_s = 3600.0 * self.tz_offset_h[idx]
        local = clock_s + tz_s
        today = np.floor(local / _DAY_S).astype(np.int64)
        hour = (local - today * _DAY_S) / 3600.0  # local hour of day, in [0, 24)
        start_h, length_h = self.start_h[idx], self.length_h[idx]
        opened_h = np.full(idx.shape, np.nan)  # window bounds in hours from today's local midnight
        closes_h = np.full(idx.shape, np.nan)
        for shift in (-1, 0, 1):  # at most one of the windows opening yesterday, today, tomorrow holds `hour`
            jitter = (2 * _uniform(self.seed, _JITTER, idx, today + shift) - 1) * c.daily_jitter_h
            start = 24.0 * shift + start_h + jitter
            end = start + length_h
            inside = (start <= hour) & (hour < end)
            opened_h[inside], closes_h[inside] = start[inside], end[inside]
        in_window = ~np.isnan(opened_h)
        opened = today * _DAY_S + 3600.0 * opened_h
        closes = today * _DAY_S + 3600.0 * closes_h
        window_day = np.floor(np.where(in_window, opened, local) / _DAY_S).astype(np.int64)
        level = 0.1 + 0.8 * _uniform(self.seed, _BATTERY, idx, window_day)
        plugged_draw = _uniform(self.seed, _PLUGGED, idx, window_day) < c.laptop_plugged_prob
        plugged = np.where(kind == _PHONE, in_window, np.where(kind == _LAPTOP, in_window & plugged_draw, True))
        full_h = np.where(kind == _PHONE, c.phone_full_charge_h, c.laptop_full_charge_h)
        charged_h = np.where(in_window, (local - opened) / 3600.0, 0.0)
        battery = np.where(plugged & (kind != _DESKTOP), np.minimum(1.0, level + charged_h / full_h), level)
        battery[kind == _DESKTOP] = np.nan
        online = self.wifi[idx] & (_uniform(self.seed, _NETWORK, idx, round) >= c.net_down_prob)
        powered_or_full = plugged | (battery >= c.min_battery)
        eligible = in_window & online & powered_or_full
        window_end_s = closes - tz_s
        return AvailabilityState(idx, eligible, in_window, plugged, battery, online, window_end_s)

    def available(self, round: int, clock_s: float) -> np.ndarray:
        """Indices of every device eligible in ``round`` at ``clock_s``."""
        return np.flatnonzero(self.state(round, clock_s).eligible)

    def completes(
        self, round: int, clock_s: float, devices: Sequence[int] | np.ndarray, duration_s: Sequence[float] | np.ndarray,
        energy_j: Sequence[float] | np.ndarray | None = None, battery_wh: Sequence[float] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Whether each device's job of ``duration_s`` started at ``clock_s`` finishes (else it drops out).

        ``energy_j`` and ``battery_wh`` (per device) let an unplugged laptop's battery drain by the job;
        without them battery drain is not checked.
        """
        st = self.state(round, clock_s, devices)
        d = np.broadcast_to(np.asarray(duration_s, dtype=float), st.devices.shape)
        if np.any(d < 0) or not np.all(np.isfinite(d)):
            raise ValueError("duration_s: must be finite and >= 0")
        inside = st.eligible & (clock_s + d <= st.window_end_s)
        survive = _uniform(self.seed, _INTERRUPT, st.devices, round) < np.exp(-self.config.interrupt_per_h * d / 3600.0)
        ok = inside & survive
        if energy_j is not None:
            if battery_wh is None:
                raise ValueError("battery_wh: needed with energy_j to drain unplugged batteries")
            e = np.broadcast_to(np.asarray(energy_j, dtype=float), st.devices.shape)
            cap = np.broadcast_to(np.asarray(battery_wh, dtype=float), st.devices.shape)
            on_battery = ~st.plugged & ~np.isnan(st.battery)
            after = st.battery - e / (3600.0 * np.where(cap > 0, cap, np.inf))
            ok &= ~on_battery | (after >= self.config.drop_battery)
        return ok
