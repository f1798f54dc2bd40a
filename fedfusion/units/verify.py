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
"""

from __future__ import annotations

import math

import torch

VECTORS = 2  # secret vectors per check: a wrong entry escapes with probability at most 2^-VECTORS


def check_flops(m: int, n: int, k: int, vectors: int = VECTORS) -> int:
    """FLOPs of one check of a product ``C (m x n) = A (m x k) @ B (k x n)``: the module's cost formula."""
    return (vectors + 1) * 2 * (m * k + k * n + m * n)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype``."""
    return torch.finfo(dtype).eps / 2


class Freivalds:
    """The randomised check with a private generator (the devices never see ``r``)."""

    R_MAX = 2.0

    def __init__(self, vectors: int = VECTORS, safety: float = 4.0, seed: int | None = None) -> None:
        if vectors < 1:
            raise ValueError("vectors must be >= 1")
        self.vectors = vectors
        self.safety = safety
        self.gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())

    def flops(self, a: torch.Tensor, b: torch.Tensor) -> int:
        """What checking ``a @ b`` costs (:func:`check_flops`)."""
        (m, k), n = a.shape, b.shape[1]
        return check_flops(m, n, k, self.vectors)

    def tolerance(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per-row tolerance of the check of ``a @ b`` (in the operands' dtype)."""
        k, n = b.shape
        bound = torch.mv(a.abs(), b.abs().sum(dim=1))
        scale = self.safety * unit_roundoff(a.dtype) * (math.sqrt(k) + math.sqrt(n)) * self.R_MAX
        return scale * bound + torch.finfo(a.dtype).tiny

    def residual(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``max_vectors |C r - A (B r)|`` per row, for fresh secret vectors (NaN when ``c`` is not finite)."""
        n = b.shape[1]
        worst = torch.zeros(a.shape[0], dtype=a.dtype)
        for _ in range(self.vectors):  # matrix-vector products: torch's CPU GEMM is slow for 2-8 columns
            sign = torch.randint(0, 2, (n,), generator=self.gen).to(a.dtype) * 2 - 1
            r = sign * (1 + torch.rand(n, generator=self.gen, dtype=a.dtype))
            worst = torch.maximum(worst, (torch.mv(c.to(a.dtype), r) - torch.mv(a, torch.mv(b, r))).abs())
        return worst

    def check(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
        """True when ``c`` passes as ``a @ b`` (right shape, finite, residual within tolerance on every row)."""
        if c.shape != (a.shape[0], b.shape[1]):
            return False
        return bool((self.residual(a, b, c) <= self.tolerance(a, b)).all())  # NaN compares False


class Strikes:
    """Failed checks per device; a device with ``limit`` strikes is blocked (gets no more units)."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.counts: dict[int, int] = {}

    def strike(self, device: int) -> None:
        self.counts[device] = self.counts.get(device, 0) + 1

    def blocked(self, device: int) -> bool:
        return self.counts.get(device, 0) >= self.limit
