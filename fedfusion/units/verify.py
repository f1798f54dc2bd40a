"""Check every returned tile before it is used: Freivalds' randomised product check, with strikes per device.

Freivalds (1977, "Probabilistic machines can use less running time", IFIP Congress) checks a claimed product
``C = A @ B`` in O(mk + kn + mn) instead of O(mnk): draw a secret random vector ``r`` and compare ``C r`` with
``A (B r)``. Slalom (Tramer & Boneh, arXiv 1806.03287) uses it to outsource the linear layers of a network to an
untrusted GPU; here the untrusted party is a phone computing a sub-matrix unit.

Floating point: ``C`` is rounded, so the comparison needs a tolerance. The check runs in the tile's dtype and
accepts row ``i`` when

    |(C r - A (B r))_i| <= tol_i,   tol_i = safety * u * (sqrt(k) + sqrt(n)) * |r|_max * (|A| (|B| 1))_i

with ``u`` the unit roundoff of the dtype and ``|r|_max = 2``: ``|A||B|`` bounds every partial sum of the
device's product and of the check's own products, and rounding errors add like a random walk (``sqrt(k)`` in
the device's and the check's inner products, ``sqrt(n)`` in ``C r``), so honest tiles sit far inside. The
entries of ``r`` are ``sign * (1 + U[0, 1))``: the random signs give Freivalds' guarantee (an entry of ``C`` wrong
by more than ``2 tol_i`` escapes one vector with probability at most 1/2, so at most ``2^-vectors``), and the
continuous magnitudes make exact cancellations between several wrong entries unlikely.

Cost: ``(vectors + 1) * 2 * (mk + kn + mn)`` FLOPs against ``2 mnk`` for the product, i.e. a fraction
``(vectors + 1) * (1/m + 1/n + 1/k)``; the engine checks each GEMM's assembled product once (the sum over its
tiles is checked with the same secret ``r``) and checks single tiles only to find the culprit when that fails.
On a CPU these are passes over memory, not FLOPs: all vectors go through an operand in one product
(``vectors @ x.T``), ``|x| v`` runs a cache-sized block at a time, and a weight's ``|B| 1`` is computed once while
its values last (:class:`Freivalds`), so a further micro-batch's product against it skips that pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

VECTORS = 2  # secret vectors per check: a wrong entry escapes with probability at most 2^-VECTORS


def check_flops(m: int, n: int, k: int, vectors: int = VECTORS) -> int:
    """FLOPs of one check of a product ``C (m x n) = A (m x k) @ B (k x n)``: the module's cost formula."""
    return (vectors + 1) * 2 * (m * k + k * n + m * n)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype``."""
    return torch.finfo(dtype).eps / 2


ABS_BLOCK = 1 << 18  # elements of |x| materialised at once by ``abs_mv`` (1 MB of float32: stays in cache)


def abs_mv(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``|x| @ v`` a block of contiguous rows at a time (of ``x``, or of ``x.T`` when ``x`` is a transposed view),
    through one reused buffer: a whole fresh ``|x|`` of a large operand costs page faults several times the
    product (measured 4-5x at 12-128 MB), and a block of a transposed view copied row by row far more."""
    base, transposed = (x.T, True) if not x.is_contiguous() and x.T.is_contiguous() else (x, False)
    rows = max(1, ABS_BLOCK // max(1, base.shape[1]))
    if base.shape[0] <= rows:
        return torch.mv(x.abs(), v)
    buf = torch.empty(rows, base.shape[1], dtype=base.dtype)
    out = torch.zeros(x.shape[0], dtype=x.dtype)
    for i in range(0, base.shape[0], rows):
        block = torch.abs(base[i:i + rows], out=buf[:min(rows, base.shape[0] - i)])
        if transposed:  # |x| v = sum over base's row blocks of |block|^T v[block]
            out.addmv_(block.T, v[i:i + rows])
        else:
            torch.mv(block, v, out=out[i:i + rows])
    return out


def _times(x: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``(x @ vectors.T).T`` as ``vectors @ x.T``: one pass over ``x`` for all vectors (measured 2x faster on CPU than
    a matrix-vector product per vector, and than ``x @ vectors.T``)."""
    return vectors @ x.T


def _row_sums(b: torch.Tensor) -> torch.Tensor:
    """``|B| 1``: the tolerance's factor of the right operand."""
    return abs_mv(b, torch.ones(b.shape[1], dtype=b.dtype))


WeightId = tuple[str, bool]  # (operand key, transposed): a weight as one product's right factor


@dataclass
class _Side:
    """A right factor's part of the check: ``r`` (vectors x n), ``(B r)^T`` (vectors x k) and ``|B| 1``."""

    r: torch.Tensor
    br: torch.Tensor
    rows: torch.Tensor


class Freivalds:
    """The randomised check with a private generator (the devices never see ``r``).

    A weight enters many products of a step (every micro-batch's forward and input gradient) with the same values:
    ``check(..., weight=...)`` keeps that weight's ``r``, ``B r`` and ``|B| 1``, and on each later product recomputes
    ``B r`` (one pass over ``B``) and reuses ``|B| 1`` (the tolerance's, the costlier pass) only when the fresh ``B r``
    equals the kept one bit for bit: a changed ``B`` moves ``B r`` unless the change happens to be orthogonal to every
    secret vector (probability 0 for continuous ``r``), so the residual always uses the ``B`` given and no version or
    fingerprint is trusted. The same ``r`` serves every product of a weight while its values last; a device learns
    of ``r`` only whether its tiles passed (strikes, re-sends), and is blocked after ``Strikes.limit`` failures."""

    R_MAX = 2.0

    def __init__(self, vectors: int = VECTORS, safety: float = 4.0, seed: int | None = None) -> None:
        if vectors < 1:
            raise ValueError("vectors must be >= 1")
        self.vectors = vectors
        self.safety = safety
        self.gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        self._weights: dict[tuple[str, bool], _Side] = {}

    def flops(self, a: torch.Tensor, b: torch.Tensor) -> int:
        """What checking ``a @ b`` costs (:func:`check_flops`)."""
        (m, k), n = a.shape, b.shape[1]
        return check_flops(m, n, k, self.vectors)

    def _draw(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``vectors`` fresh secret vectors of length ``n`` (rows): random signs, magnitudes in [1, 2)."""
        sign = torch.randint(0, 2, (self.vectors, n), generator=self.gen).to(dtype) * 2 - 1
        return sign * (1 + torch.rand(self.vectors, n, generator=self.gen, dtype=dtype))

    def _right(self, b: torch.Tensor, weight: WeightId | None) -> _Side:
        """The vectors ``r``, the products ``B r`` and ``|B| 1`` for ``b`` (a weight's ``|B| 1`` reused, see the
        class)."""
        kept = self._weights.get(weight) if weight is not None else None
        if kept is not None and kept.r.dtype == b.dtype and kept.r.shape[1] == b.shape[1] \
                and kept.rows.shape[0] == b.shape[0]:
            r, br = kept.r, _times(b, kept.r)  # the weight's vectors; new values recompute only ``|B| 1``
            if torch.equal(br, kept.br):
                return kept
        else:
            r = self._draw(b.shape[1], b.dtype)
            br = _times(b, r)
        side = _Side(r, br, _row_sums(b))
        if weight is not None:
            self._weights[weight] = side
        return side

    def _scale(self, b: torch.Tensor) -> float:
        k, n = b.shape
        return self.safety * unit_roundoff(b.dtype) * (math.sqrt(k) + math.sqrt(n)) * self.R_MAX

    def tolerance(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per-row tolerance of the check of ``a @ b`` (in the operands' dtype)."""
        return self._tolerance(a, b, _row_sums(b))

    def _tolerance(self, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The tolerance from ``|B| 1`` (``rows``): the module's formula."""
        return self._scale(b) * abs_mv(a, rows) + torch.finfo(a.dtype).tiny

    def residual(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``max_vectors |C r - A (B r)|`` per row, for fresh secret vectors (NaN when ``c`` is not finite)."""
        side = self._right(b, None)
        return self._residual(a, c, side.r, side.br)

    @staticmethod
    def _residual(a: torch.Tensor, c: torch.Tensor, r: torch.Tensor, br: torch.Tensor) -> torch.Tensor:
        return (_times(c.to(a.dtype), r) - _times(a, br)).abs().amax(dim=0)

    def check(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weight: WeightId | None = None) -> bool:
        """True when ``c`` passes as ``a @ b`` (right shape, finite, residual within tolerance on every row).
        ``weight`` names ``b`` when it is a weight (key, transposed), so its ``|B| 1`` is computed once per values."""
        if c.shape != (a.shape[0], b.shape[1]):
            return False
        side = self._right(b, weight)
        return bool((self._residual(a, c, side.r, side.br) <= self._tolerance(a, b, side.rows)).all())  # NaN compares False


class Strikes:
    """Failed checks per device; a device with ``limit`` strikes is blocked (gets no more units)."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.counts: dict[int, int] = {}

    def strike(self, device: int) -> None:
        self.counts[device] = self.counts.get(device, 0) + 1

    def blocked(self, device: int) -> bool:
        return self.counts.get(device, 0) >= self.limit
