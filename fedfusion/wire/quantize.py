"""Bytes on the wire: blockwise absmax int8 / packed int4 quantisation of the states a round moves, exact
downlink folds and error feedback on the uplink. No Flower here: plain torch, testable in milliseconds.

Format (what a Flower ArrayRecord of numpy arrays can carry: no bfloat16). A floating matrix (ndim >= 2) ``k``
travels as three arrays: ``k::q`` its codes, flattened and cut in blocks of :data:`BLOCK` values (int8 in
[-127, 127], or int4 in [-7, 7] stored +8 as two nibbles per uint8), ``k::scale`` one float16 absmax / qmax
per block, ``k::shape`` its int32 shape. Every value comes back within half a step (``scale / 2``) of what
was sent. Vectors (norm gains, biases: a fraction of a percent of the bytes, but a 1.0 gain loses 7 % to an
int4 step) travel as float16. The codes' dtype says the bits, so a reply needs no spec to be read.

Downlink: the server sends the quantised slice; the client trains from what it decodes. A reply is folded
as ``exact + (trained - received)``: the client's change from what it actually got, added to the exact
float32 slice the server kept, so the target never accumulates downlink rounding (:meth:`Wire.update`).

Uplink: a quantised reply carries the *change* ``trained - received``. With error feedback the client adds
the residual its previous upload left out (``e``) before quantising, and keeps ``delta + e - Q(delta + e)``
for the next round (:func:`client_reply`, Karimireddy et al. 2019's EF-SGD): the sum of what a client
uploaded over rounds stays within one quantisation step of the sum of its true changes, where without it the
rounding errors add up. Width slices move between rounds (rolling, random windows), so the residual is kept in
target coordinates: with a quantised uplink the server adds :data:`INDEX_KEY`, the target tensor and the target
indices of every dim of each array it sends (in runs: a rolling window is one or two runs), and the client
carries a residual over to the coordinates its next slice holds again; the residual of coordinates it no
longer holds (at most half a step each) is dropped. A LoRA adapter keeps its keys and shapes: no index needed.
A slice keeps one folded scaler for a fixed width, so residuals are kept in the slice's scaled coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedfusion.config.choices import UPLINK, WIRE_FORMATS
from fedfusion.wire.finite import all_finite

State = dict[str, torch.Tensor]
BITS = {"int8": 8, "int4": 4}
QMAX = {8: 127, 4: 7}
BLOCK = 64  # values per float16 scale: 1/32 byte of scale per value
CODES, SCALE, SHAPE = "::q", "::scale", "::shape"
INDEX_KEY = "wire::index"  # the downlink's slice index map (target coordinates of each array), uplink EF only


# -- one tensor ------------------------------------------------------------------------------------------
def quantize(t: torch.Tensor, bits: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float16 scales) of ``t`` flattened: int8 codes for 8 bits, two int4 codes per uint8 for 4."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    flat = t.detach().float().flatten()
    if not all_finite(flat):
        raise ValueError("cannot quantise NaN or Inf")
    pad = -flat.numel() % block
    # a view of ``t`` where its values fill whole blocks, and the division rounded and clamped in place: one float32
    # temporary of ``t``'s size at a time (the server quantises a whole target's embedding every round)
    blocks = (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(-1, block)
    qmax = QMAX[bits]
    # the float16 scale is what the receiver multiplies by, so codes are computed against it
    scale = (blocks.abs().amax(1) / qmax).to(torch.float16)
    if not torch.isfinite(scale).all():
        raise ValueError(f"values beyond {qmax * torch.finfo(torch.float16).max:.3g} overflow a float16 scale")
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    codes = (blocks / step).round_().clamp_(-qmax, qmax).to(torch.int8).flatten()
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return codes, scale


def _check_codes(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...], block: int) -> None:
    """ValueError where ``codes`` and ``scale`` cannot stand for a tensor of ``shape`` (an untrusted message)."""
    blocks = -(-math.prod(shape) // block)
    if codes.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"codes must be int8 or uint8 (packed int4), got {codes.dtype}")
    per_byte = 2 if codes.dtype == torch.uint8 else 1
    if codes.dim() != 1 or codes.numel() * per_byte != blocks * block or scale.shape != (blocks,):
        raise ValueError(f"{codes.numel()} codes ({codes.dtype}) and {scale.numel()} scales do not make a tensor of "
                         f"shape {shape}")
    if scale.dtype != torch.float16 or not torch.isfinite(scale).all():
        raise ValueError("scales must be finite float16")


def _values(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...], block: int = BLOCK) -> torch.Tensor:
    """The float32 tensor checked ``codes`` and ``scale`` stand for (on their device)."""
    if codes.dtype == torch.uint8:
        codes = torch.stack([(codes & 0x0F).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8], 1).flatten()
    blocks = scale.numel()
    return (codes.view(blocks, block).float() * scale.float().unsqueeze(1)).flatten()[:math.prod(shape)].view(shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...], block: int = BLOCK) -> torch.Tensor:
    """The float32 tensor of ``shape`` that :func:`quantize`'s ``codes`` and ``scale`` stand for; int8 codes are
    8-bit, uint8 codes packed int4. Raises ValueError on sizes that do not fit ``shape`` (an untrusted reply)."""
    _check_codes(codes, scale, shape, block)
    return _values(codes, scale, shape, block)


@dataclass(frozen=True)
class Packed:
    """One tensor as a message carried it, kept that narrow: int8 / packed int4 codes with their float16 scales and
    the tensor's ``dims``, or a dense (float16 / float32) tensor. :meth:`value` gives it as float32 on its device
    (:mod:`fedfusion.models.frozen` keeps a frozen target's matrices so)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    dims: tuple[int, ...] | None = None  # the tensor's shape, where ``data`` holds codes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape) if self.dims is None else self.dims

    def value(self) -> torch.Tensor:
        return self.data.float() if self.scale is None else _values(self.data, self.scale, self.shape)

    def nbytes(self) -> int:
        """Bytes it holds (codes and scales, or the dense tensor)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale) if t is not None)


# -- a state ---------------------------------------------------------------------------------------------
def _quantised(fmt: str, t: torch.Tensor) -> bool:
    return fmt in BITS and t.is_floating_point() and t.dim() >= 2


def encode(state: Mapping[str, torch.Tensor], fmt: str) -> State:
    """``state`` as a message carries it in ``fmt`` (:data:`WIRE_FORMATS`); NaN/Inf raise ValueError naming the key."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"wire format {fmt!r}: use one of {', '.join(WIRE_FORMATS)}")
    out: State = {}
    for k, t in state.items():
        if _quantised(fmt, t):
            try:
                out[k + CODES], out[k + SCALE] = quantize(t, BITS[fmt])
            except ValueError as exc:
                raise ValueError(f"{k}: {exc}") from None
            out[k + SHAPE] = torch.tensor(tuple(t.shape), dtype=torch.int32)
        elif t.is_floating_point():
            out[k] = t.detach().to(torch.float32 if fmt == "float32" else torch.float16)
        else:
            out[k] = t
    return out


def roundtrip(state: Mapping[str, torch.Tensor], fmt: str) -> tuple[State, State]:
    """(:func:`encode` of ``state``, what :func:`decode` makes of it), without decoding the message again."""
    sent = encode(state, fmt)
    back: State = {}
    for k, t in state.items():
        if k + CODES in sent:
            back[k] = dequantize(sent[k + CODES], sent[k + SCALE], tuple(t.shape))
        else:
            back[k] = sent[k].float() if sent[k].is_floating_point() else sent[k]
    return sent, back


def unpack(arrays: Mapping[str, torch.Tensor]) -> dict[str, Packed]:
    """What :func:`encode` sent, each tensor kept as it travelled (checked: a malformed quantised entry raises
    ValueError naming its key); non-float tensors come back dense as they are."""
    out: dict[str, Packed] = {}
    for k, t in arrays.items():
        if k.endswith((SCALE, SHAPE)) or k == INDEX_KEY:
            continue
        if not k.endswith(CODES):
            out[k] = Packed(t)
            continue
        name = k.removesuffix(CODES)
        if name + SCALE not in arrays or name + SHAPE not in arrays:
            raise ValueError(f"{name}: quantised codes without their {SCALE} and {SHAPE} arrays")
        shape = arrays[name + SHAPE]
        if shape.dim() != 1 or shape.is_floating_point() or bool((shape < 0).any()):
            raise ValueError(f"{name}: {SHAPE} must be a vector of non-negative integers")
        dims = tuple(int(n) for n in shape)
        try:
            _check_codes(t, arrays[name + SCALE], dims, BLOCK)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        out[name] = Packed(t, arrays[name + SCALE], dims)
    strays = [k for k in arrays if k.endswith((SCALE, SHAPE)) and k.rsplit("::", 1)[0] + CODES not in arrays]
    if strays:
        raise ValueError(f"{strays[0]}: no codes for it")
    return out


def decode(arrays: Mapping[str, torch.Tensor], keep: str | None = None) -> State:
    """What :func:`encode` sent, as float32 (non-float tensors as they are); a malformed quantised entry raises
    ValueError naming its key. Entries whose key starts with ``keep`` stay as they travelled (codes, scales and
    shapes), for a receiver that holds them narrow (:func:`unpack`)."""
    kept = {k: t for k, t in arrays.items() if keep is not None and k.startswith(keep)}
    out: State = {k: (p.value() if p.data.is_floating_point() or p.scale is not None else p.data)
                  for k, p in unpack({k: t for k, t in arrays.items() if k not in kept}).items()}
    return {**out, **kept}


def encoded_bytes(fmt: str, values: int) -> int:
    """Bytes ``values`` floats take in ``fmt`` as one matrix (codes + scales; the small shape array and the float16
    vectors of :func:`encode` are left out): what the planner prices a tier's slice at."""
    if fmt in BITS:
        blocks = -(-values // BLOCK)
        return blocks * (BLOCK * BITS[fmt] // 8 + 2)
    return values * (2 if fmt == "float16" else 4)


# -- slice index maps (target coordinates of what is sent) -------------------------------------------------
Index = tuple[int, tuple[torch.Tensor | None, ...]]  # (target tensor id, target indices per dim; None = whole)


def _runs(index: torch.Tensor) -> list[int]:
    """``index`` as [start, stop) runs of consecutive values, flattened."""
    values = index.tolist()
    runs: list[int] = []
    for v in values:
        if runs and runs[-1] == v:
            runs[-1] = v + 1
        else:
            runs += [v, v + 1]
    return runs


def pack_index(index: Mapping[str, Index]) -> torch.Tensor:
    """One int32 array holding, for each key in sorted order: its target id, its number of dims, then per dim the
    number of runs (0: the whole dim) and the runs."""
    flat: list[int] = []
    for key in sorted(index):
        tid, dims = index[key]
        flat += [tid, len(dims)]
        for d in dims:
            runs = [] if d is None else _runs(d)
            flat += [len(runs) // 2, *runs]
    return torch.tensor(flat, dtype=torch.int32)


def unpack_index(packed: torch.Tensor, keys: list[str]) -> dict[str, Index]:
    """:func:`pack_index`'s map for ``keys`` (the sent arrays' names); ValueError if it does not fit them."""
    values, at, out = packed.tolist(), 0, {}
    try:
        for key in sorted(keys):
            tid, ndim = values[at], values[at + 1]
            at += 2
            dims: list[torch.Tensor | None] = []
            for _ in range(ndim):
                n = values[at]
                runs = values[at + 1: at + 1 + 2 * n]
                at += 1 + 2 * n
                dims.append(torch.cat([torch.arange(a, b) for a, b in zip(runs[::2], runs[1::2])]) if n else None)
            out[key] = (tid, tuple(dims))
    except IndexError:
        raise ValueError(f"{INDEX_KEY} is too short for the {len(keys)} arrays sent") from None
    if at != len(values):
        raise ValueError(f"{INDEX_KEY} holds more than the {len(keys)} arrays sent")
    return out


# -- the two ends of a round -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wire:
    """How one method's payloads and replies travel: ``down`` (:data:`WIRE_FORMATS`), ``up`` (:data:`UPLINK`) and
    error feedback on a quantised uplink."""

    down: str = "float32"
    up: str = "float32"
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.down not in WIRE_FORMATS:
            raise ValueError(f"wire down {self.down!r}: use one of {', '.join(WIRE_FORMATS)}")
        if self.up not in UPLINK:
            raise ValueError(f"wire up {self.up!r}: use one of {', '.join(UPLINK)}")

    @property
    def lossless(self) -> bool:
        """Whether both ways are float32 (replies are then folded as they come)."""
        return self.down == "float32" and self.up == "float32"

    def send(self, exact: Mapping[str, torch.Tensor]) -> State:
        """The arrays a message carries for ``exact``."""
        return encode(exact, self.down)

    def received(self, exact: Mapping[str, torch.Tensor]) -> State:
        """What a client decodes from :meth:`send` (the same rounding on both ends: no need to send it back)."""
        return roundtrip(exact, self.down)[1] if self.down != "float32" else dict(exact)

    def update(self, reply: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor]) -> State:
        """A reply as trained values on the exact float32 state sent: ``exact + (trained - received)``. A quantised
        reply is that change itself; a float32 reply is the trained state. Keys of the reply missing from
        ``exact`` pass through as sent (the method's check refuses them); a change of the wrong shape raises."""
        if self.up == "float32":
            if self.down == "float32":
                return dict(reply)
            got = self.received(exact)
            return {k: exact[k] + (v.float() - got[k]) if k in exact and v.shape == exact[k].shape else v
                    for k, v in reply.items()}
        delta = decode(reply)
        out = {}
        for k, v in delta.items():
            if k in exact and v.is_floating_point():
                if v.shape != exact[k].shape:
                    raise ValueError(f"{k}: change of shape {tuple(v.shape)} for {tuple(exact[k].shape)} sent")
                out[k] = exact[k].float() + v
            else:
                out[k] = v
        return out


def client_reply(trained: Mapping[str, torch.Tensor], arrays: Mapping[str, torch.Tensor], up: str,
                 residual: Mapping[str, torch.Tensor] | None,
                 received: Mapping[str, torch.Tensor] | None = None) -> tuple[State, State]:
    """A client's reply and its residual for the next round: ``trained`` (what it trained from the message's
    ``arrays``, which decode to ``received``) as ``up`` sends it. A quantised ``up`` sends the change from what
    was received plus, with error feedback (``residual`` not None, {} in the first round), the residual of the
    previous upload, and returns the new residual in target coordinates (:func:`carry`)."""
    if up == "float32":
        return dict(trained), {}
    received = decode(arrays) if received is None else received
    index = unpack_index(arrays[INDEX_KEY], list(received)) if INDEX_KEY in arrays else None
    delta: State = {}
    for k, v in trained.items():
        if not v.is_floating_point():
            delta[k] = v
            continue
        if k not in received or received[k].shape != v.shape:
            raise ValueError(f"{k}: a quantised upload sends the change from what was received; {k} was not received "
                             "in this shape")
        delta[k] = v.float() - received[k]
    if residual is None:
        return encode(delta, up), {}
    shapes = {k: tuple(v.shape) for k, v in delta.items() if v.is_floating_point()}
    carried = carry(residual, shapes, index)
    fed = {k: v + carried[k] if k in carried else v for k, v in delta.items()}
    sent, got = roundtrip(fed, up)
    left = {k: fed[k] - got[k] for k in shapes}
    return sent, store(left, index)


def store(residual: Mapping[str, torch.Tensor], index: Mapping[str, Index] | None) -> State:
    """A residual keyed by where it lives in the target: ``t<id>`` with its target indices (``t<id>::d<n>``) when
    an index map says, else by its own key."""
    out: State = {}
    for k, v in residual.items():
        if index is None or k not in index:
            out[k] = v
            continue
        tid, dims = index[k]
        out[f"t{tid}"] = v
        for d, idx in enumerate(dims):
            if idx is not None:
                out[f"t{tid}::d{d}"] = idx
    return out


def _positions(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in ``old``, positions in ``new``) of the values both hold."""
    ordered, perm = old.sort()
    at = torch.searchsorted(ordered, new).clamp(max=len(old) - 1)
    hit = ordered[at] == new
    return perm[at[hit]], hit.nonzero().flatten()


def carry(stored: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]],
          index: Mapping[str, Index] | None) -> State:
    """The stored residual (:func:`store`) on this round's arrays (``shapes``): the coordinates held again keep
    theirs, new ones start at 0."""
    out: State = {}
    for k, shape in shapes.items():
        if index is None or k not in index:
            if k in stored and tuple(stored[k].shape) == shape:
                out[k] = stored[k]
            continue
        tid, dims = index[k]
        old = stored.get(f"t{tid}")
        if old is None or old.dim() != len(shape):
            continue
        where_old, where_new, same = [], [], True
        for d, n in enumerate(shape):
            was = stored.get(f"t{tid}::d{d}", torch.arange(old.shape[d]))
            axis = dims[d] if d < len(dims) else None
            now = axis if axis is not None else torch.arange(n)
            if len(was) != old.shape[d] or len(now) != n:
                break
            same = same and torch.equal(was, now)
            o, w = _positions(was, now)
            where_old.append(o)
            where_new.append(w)
        else:
            if same:  # the slice did not move
                out[k] = old
                continue
            value = torch.zeros(shape)
            value[torch.meshgrid(*where_new, indexing="ij")] = old[torch.meshgrid(*where_old, indexing="ij")]
            out[k] = value
    return out
