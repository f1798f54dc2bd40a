"""Secure aggregation's arithmetic (Bonawitz et al., CCS 2017: pairwise masks, self masks, Shamir-shared keys),
without Flower: what a client adds to its update and what the server may take off the sum.

A client's update travels as a vector of the target's shape (zeros where its slice holds nothing), in fixed point
(:data:`FRACTION_BITS`) modulo 2**64, plus a self mask (from a seed ``b``) and, for every other client of the round,
a pairwise mask that the pair derive from an X25519 key agreement: the lower node id adds it, the higher subtracts
it, so the pairwise masks cancel in the sum. The server takes the self masks of the clients that replied off the sum
(their ``b`` rebuilt from Shamir shares the others hold) and, for a client that dropped after the keys went out, its
pairwise masks (its mask key rebuilt the same way). An honest client reveals, for each other client, the share of
its ``b`` or of its mask key, never both, so the server can unmask the sum and never one client's vector.

Keys agree by X25519 and HKDF-SHA256, masks are ChaCha20 keystreams, shares are encrypted for their holder with
Fernet (all from ``cryptography``); the secrets are split by Flower's Shamir sharing in the Flower layer
(:mod:`fedfusion.clients.secagg`, :mod:`fedfusion.strategies.secagg`). Every round draws fresh
keys, so one key never masks two vectors.
"""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

FRACTION_BITS = 32  # fixed point: a value v travels as round(v * 2**32) modulo 2**64
LIMIT = 2.0 ** (62 - FRACTION_BITS)  # the largest |weighted update| one client may send (the sum stays below 2**63)
SEED_BYTES = 32
MASKED_BYTES = np.dtype(np.uint64).itemsize  # a masked vector's bytes per coordinate (what a plan prices)

INDEX_KEY = "secagg::index"  # the target coordinates of every trained array (fedfusion.wire.quantize.pack_index)
SCALES_KEY = "secagg::scales"  # what each trained array's values are divided by in the target (a slice's scaler)
SHAPES_KEY = "secagg::shapes"  # the shapes of the target's tensors, in the order of the masked vector
MASKED_KEY = "secagg::masked"  # a reply's masked vector (uint64)
SUPPORT_KEY = "secagg::support"  # the coordinates the round's vectors carry: those some client of the round trains
ARRAY_KEYS = (INDEX_KEY, SCALES_KEY, SHAPES_KEY, SUPPORT_KEY)
# a LoRA client whose method averages the dense update (flexlora, flora): its adapter's scaling alpha / r; its change
# travels as the change of each module's dense update, not of its factors (fedfusion.fusion.lora.aggregate)
PRODUCT_KEY = "secagg::product"
C_PUBLIC, S_PUBLIC = "secagg::cpk/", "secagg::spk/"  # + position: a client's share-sealing and mask public keys
SEALED = "secagg::sealed/"  # + position: shares sealed for (a shares reply) or from (a train message) that position
SHARE = "secagg::share/"  # + position: the share an unmask reply gives of that position's seed or mask secret


# -- keys -----------------------------------------------------------------------------------------------------------
def new_keys() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw bytes (secret, public)."""
    secret = X25519PrivateKey.generate()
    raw = secret.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return raw, secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def agree(secret: bytes, public: bytes, purpose: bytes) -> bytes:
    """The 32-byte key two clients share (each with its secret and the other's public key), for ``purpose``."""
    try:
        shared = X25519PrivateKey.from_private_bytes(secret).exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:
        raise ValueError(f"secure aggregation: a key is not an X25519 key ({exc})") from None
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedfusion-secagg " + purpose).derive(shared)


def new_seed() -> bytes:
    """A self-mask seed ``b`` from the operating system's entropy."""
    return os.urandom(SEED_BYTES)


# -- masks ----------------------------------------------------------------------------------------------------------
def stream(key: bytes, n: int) -> np.ndarray:
    """``n`` pseudo-random uint64 from ``key`` (ChaCha20's keystream: each key masks one vector)."""
    encryptor = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * n)), dtype=np.uint64).copy()


def pair_mask(secret: bytes, public: bytes, own: int, peer: int, n: int) -> np.ndarray:
    """What ``own`` adds for the pair (``own``, ``peer``): the pair's stream, plus for the lower node id and minus
    for the higher (modulo 2**64), so the two cancel in the sum."""
    mask = stream(agree(secret, public, b"mask"), n)
    return mask if own < peer else np.negative(mask)


def masked(vector: np.ndarray, own: int, seed: bytes, secret: bytes, peers: Mapping[int, bytes]) -> np.ndarray:
    """``vector`` (uint64, :func:`encode`'s) with ``own``'s self mask and its pairwise mask with each of ``peers``
    (node -> mask public key; ``own`` itself is skipped)."""
    out = vector + stream(seed, vector.size)
    for peer, public in peers.items():
        if peer != own:
            out += pair_mask(secret, public, own, peer, vector.size)
    return out


def unmask(total: np.ndarray, seeds: Mapping[int, bytes], dropped: Mapping[int, bytes],
           publics: Mapping[int, bytes], survivors: Iterable[int]) -> np.ndarray:
    """The sum of the survivors' vectors from the sum of their masked ones (``total``): their self masks (``seeds``,
    rebuilt) taken off, and each dropped client's pairwise masks with them (its mask secret in ``dropped``,
    rebuilt; ``publics``: every client's mask public key)."""
    out = total.copy()
    for seed in seeds.values():
        out -= stream(seed, out.size)
    for node, secret in dropped.items():
        for peer in survivors:  # the survivor added the pair's mask as seen from its side: the negation of node's
            out += pair_mask(secret, publics[peer], node, peer, out.size)
    return out


# -- fixed point ----------------------------------------------------------------------------------------------------
def encode(values: np.ndarray) -> np.ndarray:
    """float values as fixed point modulo 2**64 (uint64); ValueError if one is not finite or over :data:`LIMIT`."""
    values = np.asarray(values, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("secure aggregation: the update holds NaN or Inf")
    top = float(np.abs(values).max(initial=0.0))
    if top >= LIMIT:
        raise ValueError(f"secure aggregation: an update value of {top:.3g} is over the fixed point's range "
                         f"({LIMIT:.3g})")
    return np.rint(values * 2.0 ** FRACTION_BITS).astype(np.int64).view(np.uint64)


def decode(total: np.ndarray) -> np.ndarray:
    """A sum of :func:`encode`'d vectors (modulo 2**64) as float64: exact up to half a unit (2**-33) per vector
    summed."""
    return total.view(np.int64).astype(np.float64) / 2.0 ** FRACTION_BITS


# -- shares ---------------------------------------------------------------------------------------------------------
def fernet_key(secret: bytes, public: bytes) -> bytes:
    """The key a pair encrypts the shares they route through the server with."""
    return base64.urlsafe_b64encode(agree(secret, public, b"shares"))


def seal(key: bytes, src: int, dst: int, mask_share: bytes, seed_share: bytes) -> bytes:
    """``src``'s shares for ``dst`` (of its mask secret and its seed), encrypted for ``dst``."""
    head = struct.pack("<qqI", src, dst, len(mask_share))
    return Fernet(key).encrypt(head + mask_share + seed_share)


def open_sealed(key: bytes, sealed: bytes, src: int, dst: int) -> tuple[bytes, bytes]:
    """(mask share, seed share) from :func:`seal`'s output; ValueError if it is not from ``src`` for ``dst``."""
    try:
        plain = Fernet(key).decrypt(sealed)
    except Exception:
        raise ValueError(f"secure aggregation: the shares from node {src} do not decrypt") from None
    got_src, got_dst, n = struct.unpack_from("<qqI", plain)
    if (got_src, got_dst) != (src, dst):
        raise ValueError(f"secure aggregation: shares addressed {got_src}->{got_dst} arrived as {src}->{dst}")
    body = plain[struct.calcsize("<qqI"):]
    return body[:n], body[n:]


def threshold(clients: int) -> int:
    """Shares that rebuild a secret: a majority of the round's clients (at least 2)."""
    return max(2, clients // 2 + 1)


# -- the target-shaped vector ---------------------------------------------------------------------------------------
def pack_shapes(shapes: Sequence[Sequence[int]]) -> torch.Tensor:
    """The target's tensor shapes as one int64 array: per tensor its number of dims, then the dims."""
    flat: list[int] = []
    for shape in shapes:
        flat += [len(shape), *shape]
    return torch.tensor(flat, dtype=torch.int64)


def unpack_shapes(packed: torch.Tensor) -> list[tuple[int, ...]]:
    """:func:`pack_shapes`'s shapes."""
    values, at, out = packed.tolist(), 0, []
    while at < len(values):
        n = values[at]
        out.append(tuple(values[at + 1: at + 1 + n]))
        at += 1 + n
    return out


def pack_support(held: torch.Tensor) -> torch.Tensor:
    """The True positions of a flat bool vector as [start, stop) runs (int64): the round's support, which every
    client's vector is cut to (a coordinate no client trains sums to zero, so it need not travel)."""
    edges = torch.diff(torch.cat([held.new_zeros(1), held, held.new_zeros(1)]).to(torch.int8))
    return torch.stack([(edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()], 1).flatten()


def unpack_support(runs: torch.Tensor) -> np.ndarray:
    """:func:`pack_support`'s positions."""
    pairs = runs.view(-1, 2).tolist()
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in pairs]) if pairs else np.zeros(0, np.int64)


def unflatten(vector: np.ndarray, names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A flat vector (:func:`padded`'s layout) as named float32 tensors."""
    out, at = {}, 0
    for name, shape in zip(names, shapes):
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = torch.from_numpy(vector[at: at + n].reshape(shape)).float()
        at += n
    if at != vector.size:
        raise ValueError(f"secure aggregation: a vector of {vector.size} values for a target of {at}")
    return out


def dense_change(received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
                 scale: float) -> dict[str, torch.Tensor]:
    """Per LoRA module ``m`` (``m.lora_A`` (r, in), ``m.lora_B`` (out, r)), the change of its dense update
    ``scale * B @ A`` from the received adapter to the trained one, float64: what a client of a dense method adds to
    a securely summed vector, since the sum of dense updates is not a product of summed factors."""
    out = {}
    for key in sorted(trained):
        if key.endswith(".lora_A"):
            m = key.removesuffix(".lora_A")
            now = trained[f"{m}.lora_B"].double() @ trained[key].double()
            out[m] = scale * (now - received[f"{m}.lora_B"].double() @ received[key].double())
    return out
