"""What travels: one message per device per phase with all its units (operand blocks deduplicated), one reply.

Wire format (also what the byte counts measure): a 4-byte little-endian header length, a JSON header, then the
raw array bytes in header order. A message's header lists the units ``[uid, a_key, a_t, b_key, b_t]`` (the device
computes ``op(a) @ op(b)``, ``op`` transposing when the flag is set) and the arrays ``[key, dtype, shape]``; a
reply's header lists ``[uid, dtype, shape]`` of each result tile. ``compute_units`` is the whole device side.

Weight cache: operands whose key starts with ``W`` are weights; a ``DeviceRuntime`` keeps every weight block it
receives, and the server leaves out of later messages the blocks it knows the device holds. A block's wire key
carries the weight's version (``W3@17[0:64,0:128]``), so blocks go stale by themselves when the optimizer
changes the weights, and within a step the weights travel once per device however many micro-batches and
phases (forward, input gradient) use them.

Running sums (``fedfusion.units.accumulate``): a unit may carry three more fields, ``[.., sum_key, micro, emit]``:
the device adds the product to its running sum ``sum_key`` as micro-batch ``micro``'s and, when ``emit`` is the
step's micro-batch count, replies the sum (every micro-batch's product in it, or an error); with ``emit`` 0 it
keeps the product and returns no tile for it: the reply's ``"kept"`` counts such units (all of the message's or
an error reply, so the count says which).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from fedfusion.units.accumulate import RunningSums
from fedfusion.units.plan import GemmShape, Tile

# Closed-form header sizes used by the byte formula (``formula_bytes``); the measured bytes include the real ones.
# (typical lengths of the JSON header's parts with keys like ``W12@3[0:128,0:512]``; a few bytes either way)
MSG_HEADER = 40  # length prefix + {"phase":..,"units":[],"arrays":[]}
UNIT_HEADER = 50  # [uid,"X[..]",false,"W..[..]",true],
ARRAY_HEADER = 36  # ["W..[..]","<f4",[r,c]],
REPLY_HEADER = 28  # length prefix + {"phase":..,"arrays":[]}
RESULT_HEADER = 22  # [uid,"<f4",[r,c]],
SUM_HEADER = 32  # ,"dW12@3[0:128,0:512,0:256]",1,4 (a unit's running-sum fields)
KEPT_HEADER = 8  # ,"kept": before the count of kept products (a reply that keeps products in running sums)


def is_weight(name: str) -> bool:
    """Weights (cacheable on devices within a version) are the operands named ``W...``."""
    return name.startswith("W")


def block_key(name: str, version: int, r0: int, r1: int, c0: int, c1: int) -> str:
    """The wire key of a block in base coordinates (weights carry their version)."""
    return f"{name}@{version}[{r0}:{r1},{c0}:{c1}]" if is_weight(name) else f"{name}[{r0}:{r1},{c0}:{c1}]"


@dataclass(frozen=True)
class Operand:
    """A GEMM operand: ``base`` (2-D, as the server holds it) or its transpose; ``key`` names it in the phase
    (``W...`` for weights, unique per layer), ``version`` changes whenever a weight's values change."""

    key: str
    base: torch.Tensor
    t: bool = False
    version: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        r, c = self.base.shape
        return (c, r) if self.t else (r, c)

    def logical(self) -> torch.Tensor:
        """The operand as it enters the product."""
        return self.base.T if self.t else self.base

    def block(self, r0: int, r1: int, c0: int, c1: int) -> tuple[str, torch.Tensor]:
        """Key and tensor (in ``base`` coordinates) of the logical block ``[r0:r1, c0:c1]``."""
        if self.t:
            r0, r1, c0, c1 = c0, c1, r0, r1
        return block_key(self.key, self.version, r0, r1, c0, c1), self.base[r0:r1, c0:c1]


@dataclass(frozen=True)
class Gemm:
    """``a @ b`` with both operands named so blocks shared by several units travel once."""

    a: Operand
    b: Operand
    sums: str = ""  # a weight gradient: the weight and version (``W3@7``) whose step sum it adds to; "" otherwise

    @property
    def shape(self) -> GemmShape:
        (m, k), (k2, n) = self.a.shape, self.b.shape
        if k != k2:
            raise ValueError(f"inner dimensions differ: {self.a.shape} @ {self.b.shape}")
        return GemmShape(m, n, k)

    def operands(self, tile: Tile) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]:
        """The (key, block) of A and of B that ``tile`` needs."""
        return (self.a.block(tile.i0, tile.i1, tile.k0, tile.k1), self.b.block(tile.k0, tile.k1, tile.j0, tile.j1))

    def blocks(self, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical blocks ``op(A)[I, K]`` and ``op(B)[K, J]`` whose product is the tile."""
        (_, a), (_, b) = self.operands(tile)
        return (a.T if self.a.t else a), (b.T if self.b.t else b)


def _pack(header: dict[str, object], arrays: list[np.ndarray]) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(head)), head] + [np.ascontiguousarray(a).tobytes() for a in arrays])


def _unpack(payload: bytes) -> tuple[dict[str, list[list[object]]], memoryview]:
    (size,) = struct.unpack_from("<I", payload)
    return json.loads(payload[4:4 + size]), memoryview(payload)[4 + size:]


def _arrays(specs: list[list[object]], body: memoryview, shape_at: int) -> list[torch.Tensor]:
    out, offset = [], 0
    for spec in specs:
        dims: list[int] = list(spec[shape_at])  # type: ignore[call-overload]
        dtype, shape = np.dtype(str(spec[shape_at - 1])), [int(s) for s in dims]
        count = int(np.prod(shape))
        out.append(torch.from_numpy(np.frombuffer(body, dtype, count, offset).reshape(shape).copy()))
        offset += count * dtype.itemsize
    return out


SumRef = tuple[str, int, int]  # a unit's running sum: (sum key, micro-batch, emit: the step's micro-batches or 0)


def encode_units(phase: int, units: list[tuple[int, Gemm, Tile]], held: set[str] | None = None,
                 sums: dict[int, SumRef] | None = None) -> bytes:
    """The message for one device: its units and every operand block they need, each block once, except the
    weight blocks in ``held`` (the device has them); the weight blocks sent are added to ``held``. ``sums``: the
    units (by uid) whose products go to a running sum."""
    blocks: dict[str, torch.Tensor] = {}
    specs: list[list[object]] = []
    for uid, gemm, tile in units:
        (ak, ab), (bk, bb) = gemm.operands(tile)
        for key, block in ((ak, ab), (bk, bb)):
            if held is None or key not in held:
                blocks.setdefault(key, block)
        specs.append([uid, ak, gemm.a.t, bk, gemm.b.t, *(sums[uid] if sums and uid in sums else ())])
    if held is not None:
        held.update(k for k in blocks if is_weight(k))
    arrays = [b.detach().cpu().numpy() for b in blocks.values()]
    header = {"phase": phase, "units": specs,
              "arrays": [[k, a.dtype.str, list(a.shape)] for k, a in zip(blocks, arrays)]}
    return _pack(header, arrays)


def compute_units(payload: bytes, cache: dict[str, torch.Tensor] | None = None,
                  sums: RunningSums | None = None) -> bytes:
    """The device side: decode a message, compute every unit, encode the reply; weight blocks go to ``cache``,
    products of running sums to ``sums`` (``accumulate.MissingSum``: an emit without every micro-batch's)."""
    header, body = _unpack(payload)
    blocks = dict(zip((str(s[0]) for s in header["arrays"]), _arrays(header["arrays"], body, 2)))
    if cache is not None:
        for key, block in blocks.items():
            if is_weight(key):
                stem = key.split("@", 1)[0] + "@"
                for old in [k for k in cache if k.startswith(stem) and k.split("[", 1)[0] != key.split("[", 1)[0]]:
                    del cache[old]  # an older version of this weight
                cache[key] = block
        blocks = {**cache, **blocks}
    results, kept = [], 0
    sums = RunningSums() if sums is None else sums
    for uid, ak, at, bk, bt, *acc in header["units"]:
        a, b = blocks[str(ak)], blocks[str(bk)]
        product = (a.T if at else a) @ (b.T if bt else b)  # type: ignore[call-overload]
        u = int(uid)  # type: ignore[call-overload]
        if not acc:
            results.append((u, product))
            continue
        key, micro, emit = str(acc[0]), int(acc[1]), int(acc[2])  # type: ignore[call-overload]
        sums.add(key, micro, product)
        if emit:
            results.append((u, sums.emit(key, emit)))
        else:
            kept += 1
    return encode_reply(header["phase"], results, kept)  # type: ignore[arg-type]


class DeviceRuntime:
    """One device's side with its weight cache and running sums (in Flower: the ClientApp handler, both in
    ``context.state``)."""

    def __init__(self) -> None:
        self.cache: dict[str, torch.Tensor] = {}
        self.sums = RunningSums()

    def __call__(self, payload: bytes) -> bytes:
        return compute_units(payload, self.cache, self.sums)


def encode_reply(phase: int, results: list[tuple[int, torch.Tensor]], kept: int = 0) -> bytes:
    """A reply: the result tile of each unit, by unit id, and how many products the device kept in running sums."""
    arrays = [r.detach().cpu().numpy() for _, r in results]
    header: dict[str, object] = {
        "phase": phase, "arrays": [[uid, a.dtype.str, list(a.shape)] for (uid, _), a in zip(results, arrays)]}
    if kept:
        header["kept"] = kept
    return _pack(header, arrays)


def decode_reply(payload: bytes) -> dict[int, torch.Tensor]:
    """Unit id -> result tile of a reply."""
    header, body = _unpack(payload)
    return dict(zip((int(s[0]) for s in header["arrays"]), _arrays(header["arrays"], body, 2)))  # type: ignore[call-overload]


def emitting(payload: bytes) -> set[int]:
    """The ids of a message's units whose replies are running sums (what a device returns for a whole step)."""
    header, _ = _unpack(payload)
    return {int(u[0]) for u in header["units"] if len(u) > 5 and int(u[7])}  # type: ignore[call-overload]


def decode_kept(payload: bytes) -> int:
    """How many products a reply says the device kept in running sums."""
    header, _ = _unpack(payload)
    return int(header.get("kept", 0))  # type: ignore[arg-type]


Spec = tuple[str, bool, str, bool]  # (A key, A transposed, B key, B transposed): what dedup needs of a GEMM


def spec(g: Gemm) -> Spec:
    """The names and transposition flags of a GEMM's operands."""
    return (g.a.key, g.a.t, g.b.key, g.b.t)


def formula_bytes(tiles: list[Tile], specs: list[Spec], elem_bytes: int, held: set[str] | None = None,
                  versions: dict[str, int] | None = None, resident: bool = False,
                  sums: dict[int, bool] | None = None, phase: int | None = None) -> tuple[int, int]:
    """Closed-form bytes (down, up) of one device's message and reply.

    down = MSG_HEADER + UNIT_HEADER * units + sum over distinct operand blocks not already ``held`` by the device
           of (ARRAY_HEADER + elem_bytes * rows * cols);  up = REPLY_HEADER + sum over units of
           (RESULT_HEADER + elem_bytes * tile rows * cols).
    Blocks are distinct by (operand, base-coordinate range); for a single GEMM in the ``rows`` layout and nothing
    held that is ``elem_bytes * (|I| * k + k * |J|)`` down and ``elem_bytes * |I| * |J|`` up per device. The
    weight blocks counted are added to ``held`` (pass a per-device set to follow the cache through a step);
    ``versions`` gives the weights' versions (default 0) so keys match the wire's; ``resident``: every weight block
    is on the device already (a frozen base cached across steps). ``sums``: position in ``tiles`` -> whether that
    running-sum unit emits; each such unit adds SUM_HEADER down, and one that keeps its product no tile up (the
    reply's count of kept products: KEPT_HEADER and its digits). ``phase``: the message's phase id (the reply's
    header counts its digits; REPLY_HEADER assumes two), so a reply that only keeps products is priced exactly.
    """
    sums = sums or {}
    seen: set[str] = set()
    down = MSG_HEADER + UNIT_HEADER * len(tiles) + SUM_HEADER * len(sums)
    for t in tiles:
        ak, at, bk, bt = specs[t.gemm]
        for name, tr, r0, r1, c0, c1 in ((ak, at, t.i0, t.i1, t.k0, t.k1), (bk, bt, t.k0, t.k1, t.j0, t.j1)):
            version = versions.get(name, 0) if versions else 0
            key = block_key(name, version, *((c0, c1, r0, r1) if tr else (r0, r1, c0, c1)))
            if resident and is_weight(name):
                continue
            if key not in seen and (held is None or key not in held):
                seen.add(key)
                down += ARRAY_HEADER + elem_bytes * (r1 - r0) * (c1 - c0)
    if held is not None:
        held.update(k for k in seen if is_weight(k))
    kept = {u for u, emits in sums.items() if not emits}
    up = REPLY_HEADER + sum(RESULT_HEADER + elem_bytes * t.c_elems for u, t in enumerate(tiles) if u not in kept)
    up += (KEPT_HEADER + len(str(len(kept)))) if kept else 0
    up += 0 if phase is None else len(str(phase)) - 2
    return down, up
