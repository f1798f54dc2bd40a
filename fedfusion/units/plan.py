"""Cut the GEMMs of one phase into sub-matrix units sized to each device (the cost model and the planner).

A GEMM ``C (m x n) = A (m x k) @ B (k x n)`` is cut in one of three layouts:

- ``rows``: the m rows are cut into ``groups`` equal blocks, each block's n columns are shared out among a group
  of devices (a device gets ``A[I, :]`` and ``B[:, J]``, returns ``C[I, J]``);
- ``cols``: the same with the roles of rows and columns swapped;
- ``k``: the inner dimension is shared out (a device gets ``A[:, K]`` and ``B[K, :]`` and returns a partial
  ``C`` that the server sums) -- worth it when k is long and m x n small (weight gradients over many tokens).

Within a group the shares are set so every device finishes at the same predicted time (bisection on the
makespan); a device's predicted time for its message of the phase is

    t = overhead + rtt + bytes_down / down_bps + flops / flops_rate + bytes_up / up_bps

and its units must fit its memory (operands plus result). The layout and group count with the smallest
predicted makespan win. Several GEMMs of a phase (a backward's input and weight gradients) are planned one
after the other on top of the load the earlier ones put on each device, so one message per device carries all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedfusion.units.devices import UnitDevice

LAYOUTS = ("rows", "cols", "k")


@dataclass(frozen=True)
class GemmShape:
    """``C (m x n) = A (m x k) @ B (k x n)``."""

    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        """Multiply-adds counted as two FLOPs."""
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class Tile:
    """One unit: rows ``[i0, i1)``, columns ``[j0, j1)`` and inner range ``[k0, k1)`` of GEMM ``gemm`` on ``device``."""

    gemm: int
    device: int
    i0: int
    i1: int
    j0: int
    j1: int
    k0: int
    k1: int

    @property
    def flops(self) -> int:
        return 2 * (self.i1 - self.i0) * (self.j1 - self.j0) * (self.k1 - self.k0)

    @property
    def a_elems(self) -> int:
        return (self.i1 - self.i0) * (self.k1 - self.k0)

    @property
    def b_elems(self) -> int:
        return (self.k1 - self.k0) * (self.j1 - self.j0)

    @property
    def c_elems(self) -> int:
        return (self.i1 - self.i0) * (self.j1 - self.j0)


@dataclass
class Layout:
    """How one GEMM was cut."""

    kind: str
    groups: int


@dataclass
class PhasePlan:
    """The units of one phase and each device's predicted load (elements moved, FLOPs, time)."""

    tiles: list[Tile]
    layouts: list[Layout]
    down_elems: np.ndarray
    up_elems: np.ndarray
    flops: np.ndarray
    predicted_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def makespan(self) -> float:
        return float(self.predicted_s.max()) if self.predicted_s.size else 0.0


class CostModel:
    """Per-device constants of the time model, as arrays (index = device position in ``devices``)."""

    def __init__(self, devices: list[UnitDevice], elem_bytes: int = 4) -> None:
        self.devices = devices
        self.elem_bytes = elem_bytes
        self.fixed = np.array([d.overhead_s + d.rtt_s for d in devices])
        self.down = np.array([d.down_bps for d in devices]) / elem_bytes  # elements per second
        self.up = np.array([d.up_bps for d in devices]) / elem_bytes
        self.rate = np.array([d.flops for d in devices])
        self.mem = np.array([d.memory_bytes for d in devices]) / elem_bytes  # elements

    def time(self, down_elems: np.ndarray, flops: np.ndarray, up_elems: np.ndarray,
             idx: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of each device's message (zero for a device with nothing to do); ``idx``: a subset."""
        sel = slice(None) if idx is None else idx
        busy = down_elems / self.down[sel] + flops / self.rate[sel] + up_elems / self.up[sel]
        return np.where((down_elems + flops + up_elems) > 0, self.fixed[sel] + busy, 0.0)


def _per_unit(kind: str, g: GemmShape, outer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                      np.ndarray, np.ndarray, np.ndarray]:
    """For each device's outer block size: (down0, down1, up0, up1, flops1, mem0, mem1), loads = c0 + c1 * share."""
    zeros = np.zeros_like(outer, dtype=float)
    if kind == "rows":  # outer = rows of the block, share = columns
        return (outer * g.k, zeros + g.k, zeros, outer.astype(float), 2.0 * outer * g.k, outer * g.k, g.k + outer)
    if kind == "cols":  # outer = columns of the block, share = rows
        return (outer * g.k, zeros + g.k, zeros, outer.astype(float), 2.0 * outer * g.k, outer * g.k, g.k + outer)
    # k-split: share = inner range; every device returns a full m x n partial
    mn = float(g.m * g.n)
    return (zeros, zeros + g.m + g.n, zeros + mn, zeros, zeros + 2.0 * mn, zeros + mn, zeros + g.m + g.n)


def _split(cm: CostModel, devs: np.ndarray, group: np.ndarray, outer: np.ndarray, inner: int, kind: str,
           g: GemmShape, load: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, float]:
    """Shares of ``inner`` per device (all groups at once) that equalise predicted finish times within a group,
    the unit size that fits each device's memory, and the makespan."""
    down0, down1, up0, up1, fl1, mem0, mem1 = _per_unit(kind, g, outer)
    d_down, d_flops, d_up = (x[devs] for x in load)
    base = cm.time(d_down, d_flops, d_up, devs)  # what the earlier GEMMs of the phase already cost each device
    start = cm.fixed[devs] + d_down / cm.down[devs] + d_flops / cm.rate[devs] + d_up / cm.up[devs]
    c0 = down0 / cm.down[devs] + up0 / cm.up[devs]
    c1 = down1 / cm.down[devs] + up1 / cm.up[devs] + fl1 / cm.rate[devs]
    chunk = np.floor((cm.mem[devs] - mem0) / mem1).clip(min=0)  # the largest unit that fits the device's memory
    # rows/cols: a device's share may be several units (one chunk of columns/rows each, the outer block sent once);
    # k: every unit returns a full m x n partial, so the share itself must fit
    xmem = chunk if kind == "k" else np.where(chunk >= 1, float(inner), 0.0)
    ngroups = int(group.max()) + 1
    if np.any(np.bincount(group, weights=xmem, minlength=ngroups) < inner):
        return np.zeros(0), np.zeros(0), float("inf")

    def shares(t: np.ndarray) -> np.ndarray:
        return np.minimum(xmem, np.floor((t[group] - start - c0) / c1).clip(min=0))

    lo = np.zeros(ngroups)
    hi = np.full(ngroups, 1.001 * float((start + c0 + c1 * (inner + 1)).max()))
    for _ in range(64):
        mid = (lo + hi) / 2
        ok = np.bincount(group, weights=shares(mid), minlength=ngroups) >= inner
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    x = shares(hi).astype(np.int64)
    if np.any(np.bincount(group, weights=x, minlength=ngroups) < inner):
        raise RuntimeError("planner: shares do not cover the GEMM")  # a bug, not an input error
    finish = np.where(x > 0, start + c0 + c1 * x, 0.0)
    for gi in range(ngroups):  # trim the excess from the devices that finish last
        members = np.flatnonzero(group == gi)
        excess = int(x[members].sum()) - inner
        for i in members[np.argsort(-finish[members], kind="stable")]:
            if excess <= 0:
                break
            cut = min(excess, int(x[i]))
            x[i] -= cut
            excess -= cut
    finish = np.where(x > 0, start + c0 + c1 * x, base)
    return x, chunk.astype(np.int64), float(finish.max())


def _deal(order: np.ndarray, groups: int) -> np.ndarray:
    """Group index of each device, dealt in snake order of speed so groups are balanced."""
    group = np.empty(len(order), dtype=np.int64)
    for rank, dev in enumerate(order):
        lap, pos = divmod(rank, groups)
        group[dev] = pos if lap % 2 == 0 else groups - 1 - pos
    return group


def _bounds(size: int, parts: int) -> np.ndarray:
    """Boundaries of ``parts`` near-equal contiguous blocks of ``range(size)``."""
    return np.array([size * p // parts for p in range(parts + 1)], dtype=np.int64)


def plan_gemm(cm: CostModel, devs: list[int], g: GemmShape, gemm_index: int,
              load: tuple[np.ndarray, np.ndarray, np.ndarray], layouts: tuple[str, ...] = LAYOUTS,
              max_groups: int | None = None) -> tuple[list[Tile], Layout, float]:
    """The cheapest cut of one GEMM over devices ``devs`` on top of their current ``load``."""
    idx = np.array(devs, dtype=np.int64)
    speed = 1.0 / (1.0 / cm.down[idx] + 1.0 / cm.up[idx] + 1.0 / cm.rate[idx])
    order = np.argsort(-speed, kind="stable")
    best: tuple[float, str, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    for kind in layouts:
        outer_size = {"rows": g.m, "cols": g.n, "k": 1}[kind]
        inner = {"rows": g.n, "cols": g.m, "k": g.k}[kind]
        p = 1
        while p <= min(outer_size, len(devs), max_groups or len(devs)):
            group = _deal(order, p)
            bounds = _bounds(outer_size, p)
            outer = (bounds[1:] - bounds[:-1])[group]
            x, chunk, makespan = _split(cm, idx, group, outer, inner, kind, g, load)
            if best is None or makespan < best[0] - 1e-15:
                best = (makespan, kind, p, group, bounds, x, chunk)
            p *= 2
    if best is None or not np.isfinite(best[0]):
        raise ValueError(f"no layout of GEMM {g} fits the memory of devices {devs}")
    makespan, kind, p, group, bounds, x, chunk = best
    tiles: list[Tile] = []
    offsets = np.zeros(p, dtype=np.int64)
    for pos, dev in enumerate(idx):
        share = int(x[pos])
        if share == 0:
            continue
        gi = int(group[pos])
        a, b = int(bounds[gi]), int(bounds[gi + 1])
        step = share if kind == "k" else max(1, int(chunk[pos]))
        for s0 in range(int(offsets[gi]), int(offsets[gi]) + share, step):
            s1 = min(s0 + step, int(offsets[gi]) + share)
            if kind == "rows":
                tiles.append(Tile(gemm_index, int(dev), a, b, s0, s1, 0, g.k))
            elif kind == "cols":
                tiles.append(Tile(gemm_index, int(dev), s0, s1, a, b, 0, g.k))
            else:
                tiles.append(Tile(gemm_index, int(dev), 0, g.m, 0, g.n, s0, s1))
        offsets[gi] += share
    return tiles, Layout(kind, p), makespan


def tile_loads(tiles: list[Tile], ndev: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Elements down, FLOPs and elements up per device for a list of tiles (a block shared by units counted once)."""
    down, flops, up = np.zeros(ndev), np.zeros(ndev), np.zeros(ndev)
    seen: set[tuple[int, ...]] = set()
    for t in tiles:
        for key, elems in (((t.device, t.gemm, 0, t.i0, t.i1, t.k0, t.k1), t.a_elems),
                           ((t.device, t.gemm, 1, t.k0, t.k1, t.j0, t.j1), t.b_elems)):
            if key not in seen:
                seen.add(key)
                down[t.device] += elems
        flops[t.device] += t.flops
        up[t.device] += t.c_elems
    return down, flops, up


def plan_phase(cm: CostModel, devs: list[int], shapes: list[GemmShape], layouts: tuple[str, ...] = LAYOUTS,
               max_groups: int | None = None) -> PhasePlan:
    """Plan all GEMMs of one phase over the devices ``devs`` (indices into ``cm.devices``)."""
    if not devs:
        raise ValueError("no device to plan on")
    ndev = len(cm.devices)
    load = (np.zeros(ndev), np.zeros(ndev), np.zeros(ndev))
    tiles: list[Tile] = []
    chosen: list[Layout] = []
    for gi, g in enumerate(shapes):
        gt, layout, _ = plan_gemm(cm, devs, g, gi, load, layouts, max_groups)
        tiles += gt
        chosen.append(layout)
        load = tile_loads(tiles, ndev)
    down, flops, up = load
    return PhasePlan(tiles, chosen, down, up, flops, cm.time(down, flops, up))
