"""Check every returned tile before it is used: Freivalds' randomised product check, with strikes per device.

Freivalds (1977, "Probabilistic machines can use less running time", IFIP Congress) checks a claimed product
``C = A @ B`` in O(mk + kn + mn) instead of O(mnk): draw a secret random vector ``r`` and compare ``C r`` with
``A (B r)``. Slalom (Tramer & Boneh, arXiv 1806.03287) uses it to outsource the linear layers of a network to an
untrusted GPU; here the untrusted party is a phone computing a sub-matrix unit.

Floating point: ``C`` is rounded, so the comparison needs a tolerance. Per row ``i`` we accept when

    |(C r - A (B r))_i| <= tol_i,   tol_i = safety * u * sqrt(k) * (|A| (|B| |r|_max))_i

with ``u`` the unit roundoff of the tile's dtype (the check itself runs in float64) and ``|r|_max = 2``. The
entries of ``r`` are ``sign * (1 + U[0, 1))``: the random signs give Freivalds' guarantee (a wrong entry larger
than ``2 tol_i`` escapes one vector with probability at most 1/2, so at most ``2^-vectors``), and the continuous
magnitudes make exact cancellations between several wrong entries unlikely. ``sqrt(k)`` (rounding errors add
like a random walk) times ``|A||B|`` (an upper bound of every partial sum) leaves honest tiles far inside.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype``."""
    return torch.finfo(dtype).eps / 2


class Freivalds:
    """The randomised check with a private generator (the devices never see ``r``)."""

    R_MAX = 2.0

    def __init__(self, vectors: int = 2, safety: float = 4.0, seed: int | None = None) -> None:
        if vectors < 1:
            raise ValueError("vectors must be >= 1")
        self.vectors = vectors
        self.safety = safety
        self.gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())

    def tolerance(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Per-row tolerance of the check for a tile of ``dtype`` computed from ``a`` and ``b``."""
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        bound = a64.abs() @ (b64.abs().sum(dim=1) * self.R_MAX)
        return self.safety * unit_roundoff(dtype) * math.sqrt(max(a.shape[1], 1)) * bound + torch.finfo(dtype).tiny

    def residual(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``max_vectors |C r - A (B r)|`` per row, for fresh secret vectors."""
        n = b.shape[1]
        signs = torch.randint(0, 2, (n, self.vectors), generator=self.gen, dtype=torch.float64) * 2 - 1
        r = signs * (1 + torch.rand((n, self.vectors), generator=self.gen, dtype=torch.float64))
        lhs = c.to(torch.float64) @ r
        rhs = a.to(torch.float64) @ (b.to(torch.float64) @ r)
        return (lhs - rhs).abs().amax(dim=1)

    def check(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
        """True when ``c`` passes as ``a @ b`` (right shape, finite, residual within tolerance on every row)."""
        if c.shape != (a.shape[0], b.shape[1]) or not bool(torch.isfinite(c).all()):
            return False
        return bool((self.residual(a, b, c) <= self.tolerance(a, b, c.dtype)).all())


class Strikes:
    """Failed checks per device; a device with ``limit`` strikes is blocked (gets no more units)."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.counts: dict[int, int] = {}

    def strike(self, device: int) -> None:
        self.counts[device] = self.counts.get(device, 0) + 1

    def blocked(self, device: int) -> bool:
        return self.counts.get(device, 0) >= self.limit
