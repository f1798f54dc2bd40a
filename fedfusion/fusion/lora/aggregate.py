"""Aggregation of LoRA adapters whose clients use different ranks (and alphas), reusable without Flower.

Conventions, per adapted linear module: client k holds ``A_k`` (r_k, in) and ``B_k`` (out, r_k) with LoRA
alpha ``alpha_k``; its weight update is ``s_k * B_k @ A_k`` with ``s_k = alpha_k / r_k`` (peft's default
scaling). Client weights ``p_k`` (e.g. example counts) are normalised to sum 1.

Methods:
- **fedavg**: average A and B separately; needs one rank and one alpha for every client.
- **zeropad**: fold ``s_k`` into B, zero-pad every factor to the largest rank, average A and B separately.
  Biased: ``mean(B) @ mean(A) != mean(B @ A)``, so the global update is not the clients' average update.
- **hetlora**: zeropad with weights ``p_k * ||s_k B_k A_k||_F`` renormalised per module (HetLoRA's
  norm-based weighting; its rank self-pruning is a client-side matter and not here).
- **flexlora**: average the full updates ``sum p_k s_k B_k A_k``; a client of rank r gets the best rank-r
  approximation of it (truncated SVD).
- **flora**: stack the factors along the rank axis, ``B_stack @ A_stack = sum p_k s_k B_k A_k`` exactly;
  the server merges that into the base weights and clients start fresh adapters.

Factors for a client of rank r are always returned in that client's own scaling, so ``(alpha/r) * B @ A``
is the method's global update at rank r. Math runs in float64; results are float32.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field

import torch

from fedfusion.config.choices import LORA_METHODS, LORA_SECURE_METHODS
from fedfusion.wire.finite import all_finite

Factors = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
SVD = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (U, S, Vh) of a thin SVD


@dataclass
class ClientLoRA:
    """One client's trained adapters: module name -> A (r, in) and B (out, r), one alpha, one weight."""

    A: dict[str, torch.Tensor]
    B: dict[str, torch.Tensor]
    alpha: float
    weight: float = 1.0

    @property
    def rank(self) -> int:
        """The adapter rank, checked: A and B name the same modules, factors are 2-D, A's rows match B's
        columns, and every module has the same rank."""
        if set(self.A) != set(self.B):
            raise ValueError(
                f"A and B name different modules: only in A {sorted(set(self.A) - set(self.B))}, "
                f"only in B {sorted(set(self.B) - set(self.A))}"
            )
        if not self.A:
            raise ValueError("no adapted modules")
        ranks = {}
        for name in sorted(self.A):
            a, b = self.A[name], self.B[name]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
                raise ValueError(
                    f"{name}: A {tuple(a.shape)} and B {tuple(b.shape)} are not (r, in) and (out, r) with one r >= 1"
                )
            ranks[name] = a.shape[0]
        if len(set(ranks.values())) > 1:
            raise ValueError(f"modules have different ranks {ranks}; a client has one rank")
        return next(iter(ranks.values()))

    @property
    def scale(self) -> float:
        """peft's LoRA scaling alpha / r."""
        return self.alpha / self.rank


def effective_delta(A: torch.Tensor, B: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weight update ``(alpha / r) * B @ A`` of one module, float32."""
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
        raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} are not (r, in) and (out, r)")
    return (alpha / A.shape[0] * (B.double() @ A.double())).float()


@dataclass
class LoRAAggregate:
    """The result of one aggregation: the global update per module and how clients continue from it.

    ``A``/``B`` are the global factors with ``delta = scale * B @ A``: the averaged factors for fedavg
    (scale alpha/r), the scale-folded padded averages for zeropad/hetlora and the stacks for flora (scale 1).
    flexlora's global state is ``delta`` itself; where its factors are known (the clients' stack, float64, or the
    global factors of a previous round) they are kept too (scale 1), so its SVD runs on them
    (:func:`factored_svd`, a few ms a module) rather than on the (out, in) update (about 0.5 s for 1536 x 576);
    empty when only the dense update is (secure aggregation's sum).
    """

    method: str
    delta: dict[str, torch.Tensor]
    merge_into_base: bool
    A: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    B: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    scale: float = 1.0
    _svd: dict[str, SVD] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def for_client(self, rank: int, alpha: float) -> Factors:
        """The (A, B) a client of this rank and alpha starts its next round from, so that its
        ``(alpha/rank) * B @ A`` is the method's global update at that rank. flora serves none (ValueError): its
        update is merged into the base (``merge_into_base``) and clients start fresh adapters (:func:`serve`).

        fedavg serves only the aggregated rank (B rescaled if alpha differs); zeropad/hetlora serve the first ``rank`` components, up to
        the largest aggregated rank; flexlora serves the top-``rank`` SVD components (``rank`` up to min(out, in)), all
        the update has where it has fewer (its factors' rank).
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be positive and finite, got {alpha!r}")
        if self.merge_into_base:
            raise ValueError(f"{self.method} serves no adapter: its update is merged into the base weights "
                             "(merge_into_base) and every client starts a fresh adapter on the merged base")
        s = alpha / rank
        if self.method == "flexlora":
            return self._top_components(rank, s)
        held = next(iter(self.A.values())).shape[0]
        if self.method == "fedavg" and rank != held:
            raise ValueError(f"fedavg aggregated rank {held} adapters and cannot serve rank {rank}")
        if rank > held:
            raise ValueError(f"{self.method}: rank {rank} exceeds the largest aggregated rank {held}")
        A = {n: a[:rank].clone() for n, a in self.A.items()}
        B = {n: b[:, :rank] * (self.scale / s) for n, b in self.B.items()}
        return A, B

    def components(self, name: str) -> SVD:
        """flexlora: the thin SVD of module ``name``'s update, signs fixed, computed once: from its factors where
        they are known, else from the dense update."""
        if name not in self._svd:
            self._svd[name] = factored_svd(self.A[name], self.B[name]) if name in self.A else \
                dense_svd(self.delta[name])
        return self._svd[name]

    def _top_components(self, rank: int, s: float) -> Factors:
        """The top-``rank`` SVD components of each module's update, in a client's scaling ``s``: all the update
        holds where its factors are known and fewer (its rank; the client initialises the rest fresh)."""
        A, B = {}, {}
        for name, delta in self.delta.items():
            if rank > min(delta.shape):
                raise ValueError(f"flexlora: rank {rank} exceeds min(out, in) = {min(delta.shape)} of module {name}")
            U, S, Vh = self.components(name)
            k = min(rank, S.numel())
            A[name] = Vh[:k].float()
            B[name] = (U[:, :k] * S[:k] / s).float()
        return A, B


def _sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The terms added left to right (at least one)."""
    return functools.reduce(operator.add, terms)


def _f32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in tensors.items()}


def _weights(clients: list[ClientLoRA]) -> tuple[list[float], list[int]]:
    """Validate the clients against each other; return normalised weights p_k and ranks r_k."""
    if not clients:
        raise ValueError("no clients to aggregate")
    first = clients[0]
    ranks = []
    for k, c in enumerate(clients):
        try:
            ranks.append(c.rank)
        except ValueError as e:
            raise ValueError(f"client {k}: {e}") from e
        if set(c.A) != set(first.A):
            raise ValueError(
                f"client {k} adapts different modules than client 0: missing {sorted(set(first.A) - set(c.A))}, "
                f"extra {sorted(set(c.A) - set(first.A))}"
            )
        for name in sorted(c.A):
            a, b = c.A[name], c.B[name]
            if a.shape[1] != first.A[name].shape[1] or b.shape[0] != first.B[name].shape[0]:
                raise ValueError(
                    f"client {k}, {name}: (out, in) = {(b.shape[0], a.shape[1])} but client 0 has "
                    f"{(first.B[name].shape[0], first.A[name].shape[1])}"
                )
            if not (all_finite(a) and all_finite(b)):
                raise ValueError(f"client {k}, {name}: A or B holds NaN or Inf")
        if not (math.isfinite(c.weight) and c.weight > 0):
            raise ValueError(f"client {k}: weight must be positive and finite, got {c.weight!r}")
        if not (math.isfinite(c.alpha) and c.alpha > 0):
            raise ValueError(f"client {k}: alpha must be positive and finite, got {c.alpha!r}")
    total = sum(c.weight for c in clients)
    return [c.weight / total for c in clients], ranks


def _stack(clients: list[ClientLoRA], p: list[float], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's stacking of one module in float64: cat_k(p_k s_k A_k) over rows, cat_k(B_k) over columns."""
    A = torch.cat([pk * c.scale * c.A[name].double() for c, pk in zip(clients, p)], dim=0)
    B = torch.cat([c.B[name].double() for c in clients], dim=1)
    return A, B


def _padded_mean(
    clients: list[ClientLoRA], ranks: list[int], weights: list[float], name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted means of A_k and s_k B_k zero-padded to the largest rank, float64."""
    a0, b0 = clients[0].A[name], clients[0].B[name]
    r_max = max(ranks)
    A = torch.zeros(r_max, a0.shape[1], dtype=torch.float64, device=a0.device)
    B = torch.zeros(b0.shape[0], r_max, dtype=torch.float64, device=b0.device)
    for c, r, w in zip(clients, ranks, weights):
        A[:r] += w * c.A[name].double()
        B[:, :r] += w * (c.alpha / r) * c.B[name].double()
    return A, B


def _norm_weights(clients: list[ClientLoRA], ranks: list[int], p: list[float], name: str) -> list[float]:
    """HetLoRA's weights p_k * ||s_k B_k A_k||_F renormalised; p itself if every update is zero."""
    norms = []
    for c, r, pk in zip(clients, ranks, p):
        a, b = c.A[name].double(), c.B[name].double()
        # ||B A||_F^2 = trace(A A^T B^T B): r x r products instead of the (out, in) update.
        sq = ((a @ a.T) * (b.T @ b)).sum().clamp_min(0.0)
        norms.append(pk * (c.alpha / r) * float(sq.sqrt()))
    total = sum(norms)
    return [n / total for n in norms] if total > 0 else p


def _check_one_rank(clients: list[ClientLoRA], ranks: list[int]) -> None:
    """fedavg averages A and B separately: every client must have one rank and one alpha."""
    alphas = [c.alpha for c in clients]
    if len(set(ranks)) > 1 or len(set(alphas)) > 1:
        raise ValueError(f"fedavg needs one rank and one alpha for all clients, got ranks {ranks}, alphas {alphas}")


def flora_stack(clients: list[ClientLoRA]) -> Factors:
    """FLoRA's stacked factors per module: A_stack (sum r_k, in) = cat_k(p_k s_k A_k) and
    B_stack (out, sum r_k) = cat_k(B_k), so B_stack @ A_stack = sum_k p_k s_k B_k A_k exactly."""
    p, _ = _weights(clients)
    A, B = {}, {}
    for name in sorted(clients[0].A):
        a, b = _stack(clients, p, name)
        A[name], B[name] = a.float(), b.float()
    return A, B


def aggregate_lora(clients: list[ClientLoRA], method: str) -> LoRAAggregate:
    """Aggregate the clients' adapters of every module with ``method`` (one of LORA_METHODS)."""
    if method not in LORA_METHODS:
        raise ValueError(f"unknown LoRA aggregation method {method!r}; use one of {', '.join(LORA_METHODS)}")
    p, ranks = _weights(clients)
    names = sorted(clients[0].A)
    if method == "fedavg":
        _check_one_rank(clients, ranks)
        s = clients[0].scale
        A = {n: _sum([pk * c.A[n].double() for c, pk in zip(clients, p)]) for n in names}
        B = {n: _sum([pk * c.B[n].double() for c, pk in zip(clients, p)]) for n in names}
        delta = {n: (s * B[n] @ A[n]).float() for n in names}
        return LoRAAggregate(method, delta, False, _f32(A), _f32(B), s)
    if method in ("zeropad", "hetlora"):
        A, B = {}, {}
        for n in names:
            w = _norm_weights(clients, ranks, p, n) if method == "hetlora" else p
            A[n], B[n] = _padded_mean(clients, ranks, w, n)
        delta = {n: (B[n] @ A[n]).float() for n in names}
        return LoRAAggregate(method, delta, False, _f32(A), _f32(B), 1.0)
    stacks = {n: _stack(clients, p, n) for n in names}
    delta = {n: (b @ a).float() for n, (a, b) in stacks.items()}
    A = {n: a for n, (a, _) in stacks.items()}
    B = {n: b for n, (_, b) in stacks.items()}
    if method == "flexlora":  # the float64 stacks: its SVD runs on them
        return LoRAAggregate(method, delta, False, A, B, 1.0)
    return LoRAAggregate(method, delta, True, _f32(A), _f32(B), 1.0)


# -- secure aggregation: the aggregate from one sum of the clients' weighted changes ----------------------------------
DENSE_METHODS = ("flexlora", "flora")  # the methods that average the dense update rather than the factors


def aggregate_sum(method: str, starts: list[ClientLoRA], total: dict[str, torch.Tensor]) -> LoRAAggregate:
    """The aggregate :func:`aggregate_lora` makes of the trained clients, from their starting adapters ``starts``
    (factors, alpha, weight: what the server sent) and ``total``, the unmasked sum of their weighted changes: for
    the dense methods per module ``m`` the sum of ``w_k`` x :func:`fedfusion.wire.secagg.dense_change`; for fedavg and zeropad per factor
    (``m.lora_A`` (R, in), ``m.lora_B`` (out, R), R the largest rank) the sum of ``w_k`` x the change of ``A_k`` and
    of ``s_k B_k`` zero-padded to R. Each start is known to the server, so only the sum of changes travels."""
    if method not in LORA_SECURE_METHODS:
        raise ValueError(f"secure aggregation cannot fold lora.method={method!r}: use one of {LORA_SECURE_METHODS}")
    p, ranks = _weights(starts)
    if method == "fedavg":
        _check_one_rank(starts, ranks)
    names = sorted(starts[0].A)
    weight = sum(c.weight for c in starts)
    if method in DENSE_METHODS:
        delta = {n: (_sum([pk * c.scale * (c.B[n].double() @ c.A[n].double()) for c, pk in zip(starts, p)])
                     + total[n].double() / weight) for n in names}
        if method == "flexlora":
            return LoRAAggregate(method, _f32(delta), False)
        factors = {n: torch.linalg.svd(d, full_matrices=False) for n, d in delta.items()}
        return LoRAAggregate(method, _f32(delta), True, {n: vh.float() for n, (_, _, vh) in factors.items()},
                             {n: (u * s).float() for n, (u, s, _) in factors.items()}, 1.0)
    A, B = {}, {}
    for n in names:
        a, b = _padded_mean(starts, ranks, p, n)
        A[n], B[n] = a + total[f"{n}.lora_A"].double() / weight, b + total[f"{n}.lora_B"].double() / weight
    if method == "fedavg":
        s = starts[0].scale
        return LoRAAggregate(method, {n: (B[n] @ A[n]).float() for n in names}, False, _f32(A),
                             {n: (b / s).float() for n, b in B.items()}, s)
    return LoRAAggregate(method, {n: (B[n] @ A[n]).float() for n in names}, False, _f32(A), _f32(B), 1.0)


# -- the global update as one low-rank pair per module (what the Flower layer carries between rounds) ------
def _signed(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor) -> SVD:
    """The SVD with each component's sign fixed (the largest entry of U's column positive), so that the factors a
    client is served depend on the update alone, not on how its SVD was computed (a client's training is not
    sign-symmetric once its change is quantised or clipped per coordinate)."""
    signs = torch.sign(U.gather(0, U.abs().argmax(0, keepdim=True))).squeeze(0)
    signs[signs == 0] = 1.0
    return U * signs, S, Vh * signs[:, None]


def dense_svd(delta: torch.Tensor) -> SVD:
    """The thin SVD of an (out, in) update in float64, signs fixed as :func:`factored_svd`'s."""
    return _signed(*torch.linalg.svd(delta.double(), full_matrices=False))


def factored_svd(A: torch.Tensor, B: torch.Tensor) -> SVD:
    """The thin SVD ``(U, S, Vh)`` of ``B @ A`` in float64 from its factors: two thin QRs and the SVD of the small
    core ``R_B R_A^T``, never the (out, in) product. Its components number at most the factors' rank r."""
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
        raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} are not (r, in) and (out, r)")
    qb, rb = torch.linalg.qr(B.double())
    qa, ra = torch.linalg.qr(A.double().T)
    U, S, Vh = torch.linalg.svd(rb @ ra.T, full_matrices=False)
    return _signed(qb @ U, S, Vh @ qa.T)


def _leading(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, rtol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 factors (A', B') = (Vh, U S) of the singular directions whose value exceeds ``rtol`` times the
    largest (at least one): the product's numerical rank."""
    keep = max(1, int((S > rtol * S[0]).sum())) if S.numel() and S[0] > 0 else 1
    return Vh[:keep].float(), (U[:, :keep] * S[:keep]).float()


def compress_factors(A: torch.Tensor, B: torch.Tensor, rtol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (A', B') with ``B' @ A' == B @ A`` to float tolerance and the fewest rows: the product's
    singular directions whose singular value exceeds ``rtol`` times the largest (at least one), from
    :func:`factored_svd`."""
    return _leading(*factored_svd(A, B), rtol=rtol)


def global_factors(agg: LoRAAggregate, merged: Factors | None = None) -> Factors:
    """The round's global update relative to the original base, per module ``B @ A`` (scale 1).

    fedavg, zeropad, hetlora: the aggregate's own factors with the scale folded into B, in their order, so
    that the first r components are what a rank-r client is served. flexlora: the averaged update
    compressed to its numerical rank. flora: ``merged`` (the updates merged into the base in earlier
    rounds) plus this round's stack, compressed: FLoRA's clients start fresh on the merged base.
    """
    if agg.method == "flora":
        A, B = {}, {}
        for name in agg.A:
            a, b = agg.A[name], agg.B[name]
            if merged is not None and name in merged[0]:
                a, b = torch.cat([merged[0][name], a]), torch.cat([merged[1][name], b], dim=1)
            A[name], B[name] = compress_factors(a, b)
        return A, B
    if agg.method == "flexlora":
        A, B = {}, {}
        for name in agg.delta:
            A[name], B[name] = _leading(*agg.components(name))
        return A, B
    return {n: a.clone() for n, a in agg.A.items()}, {n: b * agg.scale for n, b in agg.B.items()}


def from_global(method: str, A: dict[str, torch.Tensor], B: dict[str, torch.Tensor]) -> LoRAAggregate:
    """The :class:`LoRAAggregate` that serves clients from global factors written by :func:`global_factors`."""
    if method not in LORA_METHODS:
        raise ValueError(f"unknown LoRA aggregation method {method!r}; use one of {', '.join(LORA_METHODS)}")
    if set(A) != set(B):
        raise ValueError(f"global A and B name different modules: {sorted(set(A) ^ set(B))}")
    delta = {n: (B[n].double() @ A[n].double()).float() for n in A}
    return LoRAAggregate(method, delta, method == "flora", dict(A), dict(B), 1.0)


def serve(agg: LoRAAggregate, rank: int, alpha: float) -> Factors | None:
    """What a client of ``rank`` and ``alpha`` starts from: nothing (None: a fresh adapter) where the update was
    merged into the base (flora); ``for_client`` when the aggregate holds that many components, else the
    components it holds (k < rank) scaled for the client, so that ``(alpha / rank) * B @ A`` is still the global
    update; the client initialises its remaining components fresh (B = 0)."""
    if agg.merge_into_base:
        return None
    if agg.method in ("zeropad", "hetlora"):
        held = next(iter(agg.A.values())).shape[0]
        if rank > held:
            return agg.for_client(held, alpha * held / rank)
    return agg.for_client(rank, alpha)


def starting_adapter(shapes: dict[str, tuple[int, int]], rank: int, served: Factors | None, seed: int) -> Factors:
    """The whole rank-``rank`` adapter a client starts a round from: peft's fresh initialisation (A
    Kaiming-uniform with a = sqrt(5), B = 0; seeded) with the ``served`` components (k <= rank) in front.

    Sending the client its whole starting adapter, not only the served components, makes its reply
    comparable key by key and shape by shape with what it was sent, which Flower's DP mods need to clip
    ``reply - sent``; the fresh components have B = 0, so the adapter's update is still the served one.
    """
    generator = torch.Generator().manual_seed(seed)
    A, B = {}, {}
    for name, (out, inp) in shapes.items():
        a, b = torch.empty(rank, inp), torch.zeros(out, rank)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        if served is not None:
            sa, sb = served[0][name], served[1][name]
            k = sa.shape[0]
            if k > rank or tuple(sa.shape) != (k, inp) or tuple(sb.shape) != (out, k):
                raise ValueError(f"{name}: served A {tuple(sa.shape)}, B {tuple(sb.shape)} do not fit a rank-{rank} "
                                 f"adapter of ({out}, {inp})")
            a[:k], b[:, :k] = sa, sb
        A[name], B[name] = a, b
    return A, B


def merged_arrays(A: dict[str, torch.Tensor], B: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A global update as frozen wire arrays: per module its factors ``m.merged_A`` (K, in) and ``m.merged_B``
    (out, K), or their product ``m.merged_W`` (out, in) where that is fewer numbers, i.e. once the stacked
    rank K passes in * out / (in + out) (FLoRA's stack grows with the rounds; a full-rank one sent as
    factors would be twice a dense update)."""
    out: dict[str, torch.Tensor] = {}
    for name, a in A.items():
        b = B[name]
        rank, inp = a.shape
        if rank * (inp + b.shape[0]) > inp * b.shape[0]:
            out[f"{name}.merged_W"] = b @ a
        else:
            out[f"{name}.merged_A"], out[f"{name}.merged_B"] = a, b
    return out
