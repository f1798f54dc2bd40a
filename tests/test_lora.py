"""Exactness properties of heterogeneous-rank LoRA aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from fp_bounds import assert_product_within_bound, assert_within, gamma

from fedfusion.config.choices import LORA_METHODS as METHODS
from fedfusion.fusion.lora.aggregate import ClientLoRA, aggregate_lora, effective_delta, flora_stack, merged_arrays, serve

SHAPES = {"q_proj": (16, 24), "v_proj": (20, 24), "o_proj": (24, 16)}  # module -> (out, in); min dim 16
RANKS, ALPHAS, WEIGHTS = [8, 4, 2, 1], [16.0, 4.0, 8.0, 1.0], [10.0, 30.0, 20.0, 40.0]
# The aggregation runs in float64 from the clients' float32 factors and rounds its results to float32: each result
# is within a few float32 roundings (the served factors, their rescaling, the product's) of the exact value, relative
# to ``size``, the magnitudes the exact value is a signed sum of (``|B| |A|`` per client, weighted); the float64
# arithmetic adds ``gamma_64`` of float64 on the same magnitudes. Two float32 results of the same value: twice that.
ROUNDINGS = gamma(4, torch.float32) + gamma(64, torch.float64)


def client(rank: int, alpha: float, weight: float = 1.0, seed: int = 0) -> ClientLoRA:
    g = torch.Generator().manual_seed(seed)
    A = {n: 0.3 * torch.randn(rank, i, generator=g) for n, (_, i) in SHAPES.items()}
    B = {n: 0.3 * torch.randn(o, rank, generator=g) for n, (o, _) in SHAPES.items()}
    return ClientLoRA(A, B, alpha, weight)


def hetero() -> list[ClientLoRA]:
    return [client(r, a, w, seed=k) for k, (r, a, w) in enumerate(zip(RANKS, ALPHAS, WEIGHTS))]


def weighted_sum(clients: list[ClientLoRA]) -> dict[str, torch.Tensor]:
    """sum_k p_k s_k B_k A_k per module, in float64."""
    p = [c.weight / sum(d.weight for d in clients) for c in clients]
    return {
        n: sum(pk * c.scale * c.B[n].double() @ c.A[n].double() for c, pk in zip(clients, p)) for n in SHAPES
    }


def served(agg, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """The effective update ``(alpha / rank) B @ A`` a client of this rank/alpha starts from (its adapter holds the
    k <= rank served components in front, fresh ones with B = 0 behind)."""
    A, B = agg.for_client(rank, alpha)
    return {n: (alpha / rank * (B[n].double() @ A[n].double())).float() for n in SHAPES}


def assert_dicts_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], size: dict[str, torch.Tensor],
                       times: float = 1.0, truncated: bool = False) -> None:
    """Every module's ``got`` within ``times * ROUNDINGS * size`` of ``want`` (exact: float64 from float32 inputs).

    ``truncated``: ``got`` is flexlora's truncated SVD of the float32 aggregate of a rank-r ``want``; that aggregate
    is off by ``E``, ``|E| <= ROUNDINGS size``, so its trailing singular values are rounding noise and the truncation
    moves every entry by up to ``||E||_2 <= ||E||_F`` (Weyl; Eckart-Young bounds the whole by ``2 ||E||_F``)."""
    assert set(got) == set(want)
    for n in want:
        bound = times * ROUNDINGS * size[n]
        if truncated:
            bound = bound + 2 * ROUNDINGS * torch.linalg.matrix_norm(size[n])
        assert_within(got[n], want[n], bound)


def magnitude(clients: list[ClientLoRA], weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """``sum_k p_k s_k |B_k| |A_k|`` per module (``p`` the clients' shares unless ``weights``): what a weighted sum
    of the updates adds up."""
    p = weights or [c.weight / sum(d.weight for d in clients) for c in clients]
    return {n: sum(pk * c.scale * c.B[n].double().abs() @ c.A[n].double().abs() for c, pk in zip(clients, p))
            for n in SHAPES}


def product_size(A: dict[str, torch.Tensor], B: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """``scale |B| |A|`` per module."""
    return {n: scale * B[n].double().abs() @ A[n].double().abs() for n in A}



def assert_padded_mean(delta: torch.Tensor, clients, weights, n: str) -> None:
    """``delta`` is (sum_k w_k s_k B_k padded to rank 8) @ (sum_k w_k A_k padded), within the float32 roundings of
    the same sums of magnitudes."""
    def mean(part, rows: bool, magnitude: bool) -> torch.Tensor:
        return sum(w * (1.0 if rows else c.scale) * torch.nn.functional.pad(
            getattr(c, part)[n].double().abs() if magnitude else getattr(c, part)[n].double(),
            (0, 0, 0, 8 - c.rank) if rows else (0, 8 - c.rank)) for c, w in zip(clients, weights))

    assert_within(delta, mean("B", False, False) @ mean("A", True, False),
                  ROUNDINGS * mean("B", False, True) @ mean("A", True, True))

def test_effective_delta_is_peft_scaling():
    c = client(4, 16.0)
    for n in SHAPES:
        d = effective_delta(c.A[n], c.B[n], 16.0)
        assert d.dtype == torch.float32 and d.shape == SHAPES[n]
        want = 4.0 * c.B[n].double() @ c.A[n].double()
        assert_within(d, want, ROUNDINGS * 4.0 * c.B[n].double().abs() @ c.A[n].double().abs())


def test_flora_stack_product_is_the_weighted_sum_of_updates():
    clients = hetero()
    A, B = flora_stack(clients)
    want = weighted_sum(clients)
    for n, (out, inp) in SHAPES.items():
        assert A[n].shape == (sum(RANKS), inp) and B[n].shape == (out, sum(RANKS))
    assert_dicts_close({n: B[n].double() @ A[n].double() for n in SHAPES}, want, magnitude(clients))
    agg = aggregate_lora(clients, "flora")
    assert agg.merge_into_base and serve(agg, 8, 16.0) is None
    with pytest.raises(ValueError, match="flora serves no adapter: its update is merged into the base weights"):
        agg.for_client(8, 16.0)
    assert_dicts_close(agg.delta, want, magnitude(clients))


@pytest.mark.parametrize("rank", [1, 2, 4, 8, 15, 16])
def test_flexlora_serves_the_truncated_svd_of_the_averaged_update(rank):
    clients = hetero()
    agg = aggregate_lora(clients, "flexlora")
    assert not agg.merge_into_base
    want = weighted_sum(clients)
    assert_dicts_close(agg.delta, want, magnitude(clients))
    got = served(agg, rank, alpha=2.0 * rank + 1)
    for n in SHAPES:
        exact = want[n]  # the SVD runs on the clients' float64 stack, whose product is this sum
        U, S, Vh = torch.linalg.svd(exact, full_matrices=False)
        # the served factors' and product's float32 roundings on |U| S |Vh|; the float64 QRs' and SVDs' backward
        # errors (gamma_{n^2} ||B|| ||A|| of the stack, both computations) moving the rank-r truncation by up to
        # (2 + 4 S_1 / gap) of that (Wedin), the gap S_r - S_{r+1} of the exact sum
        stack_a, stack_b = agg.A[n], agg.B[n]
        backward = gamma(max(exact.shape) ** 2, torch.float64) * float(
            torch.linalg.matrix_norm(stack_b) * torch.linalg.matrix_norm(stack_a) + torch.linalg.matrix_norm(exact))
        held = sum(RANKS)  # the sum's rank: a larger client rank is served all of it
        wedin = 2 + 4 * float(S[0] / (S[rank - 1] - S[rank])) if rank < held else 2
        bound = ROUNDINGS * (U[:, :rank].abs() * S[:rank]) @ Vh[:rank].abs() + backward * wedin
        assert_within(got[n], U[:, :rank] * S[:rank] @ Vh[:rank], bound)
        err = torch.linalg.matrix_norm(exact - got[n].double())
        discarded = S[rank:]  # Eckart-Young, off by at most the served update's error
        assert abs(float(err) - float(discarded.square().sum().sqrt())) <= float(torch.linalg.matrix_norm(bound))


def test_flexlora_rejects_a_rank_above_the_smallest_module_dimension():
    with pytest.raises(ValueError, match="exceeds min"):
        aggregate_lora(hetero(), "flexlora").for_client(17, 16.0)


def test_zeropad_equals_fedavg_for_equal_ranks_and_alpha():
    clients = [client(4, 8.0, w, seed=k) for k, w in enumerate(WEIGHTS)]
    fedavg, zeropad = aggregate_lora(clients, "fedavg"), aggregate_lora(clients, "zeropad")
    p = [w / sum(WEIGHTS) for w in WEIGHTS]
    size_a = {n: sum(pk * c.A[n].double().abs() for c, pk in zip(clients, p)) for n in SHAPES}
    size_b = {n: sum(pk * c.B[n].double().abs() for c, pk in zip(clients, p)) for n in SHAPES}
    assert_dicts_close(zeropad.delta, fedavg.delta, product_size(size_a, size_b, 2.0), times=2)
    (Af, Bf), (Az, Bz) = fedavg.for_client(4, 8.0), zeropad.for_client(4, 8.0)
    assert_dicts_close(Az, Af, size_a, times=2)
    assert_dicts_close(Bz, Bf, size_b, times=2)
    assert_dicts_close(Af, {n: sum(pk * c.A[n].double() for c, pk in zip(clients, p)) for n in SHAPES}, size_a)
    assert_dicts_close(Bf, {n: sum(pk * c.B[n].double() for c, pk in zip(clients, p)) for n in SHAPES}, size_b)


@pytest.mark.parametrize("method", ["zeropad", "hetlora"])
def test_padded_methods_serve_the_leading_components_of_the_global_factors(method):
    agg = aggregate_lora(hetero(), method)
    assert {a.shape[0] for a in agg.A.values()} == {max(RANKS)}
    assert_dicts_close(agg.delta, {n: agg.B[n].double() @ agg.A[n].double() for n in SHAPES}, product_size(agg.A, agg.B))
    for rank in (1, 3, 8):
        A, B = {n: a[:rank] for n, a in agg.A.items()}, {n: b[:, :rank] for n, b in agg.B.items()}
        assert_dicts_close(served(agg, rank, alpha=32.0), {n: B[n].double() @ A[n].double() for n in SHAPES},
                           product_size(A, B))
    with pytest.raises(ValueError, match="exceeds the largest aggregated rank 8"):
        agg.for_client(9, 16.0)


def test_zeropad_is_the_padded_average_and_biased():
    clients = hetero()
    agg = aggregate_lora(clients, "zeropad")
    p = [w / sum(WEIGHTS) for w in WEIGHTS]
    for n in SHAPES:
        assert_padded_mean(agg.delta[n], clients, p, n)
        assert not torch.allclose(agg.delta[n].double(), weighted_sum(clients)[n], atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rank, alpha", [(8, 16.0), (4, 4.0), (2, 1.0)])
def test_one_client_round_trips_unchanged(method, rank, alpha):
    c = client(rank, alpha, weight=3.0)
    agg = aggregate_lora([c], method)
    own = {n: effective_delta(c.A[n], c.B[n], alpha) for n in SHAPES}
    size = magnitude([c])
    assert_dicts_close(agg.delta, own, size, times=2)
    if method == "flora":
        assert serve(agg, rank, alpha) is None
    else:
        assert_dicts_close(served(agg, rank, alpha), own, size, times=2, truncated=method == "flexlora")


@pytest.mark.parametrize("method", METHODS)
def test_identical_clients_aggregate_to_their_update(method):
    clients = [client(4, 16.0, w, seed=7) for w in (1.0, 5.0, 2.0)]
    own = {n: effective_delta(clients[0].A[n], clients[0].B[n], 16.0) for n in SHAPES}
    size = magnitude(clients[:1])
    agg = aggregate_lora(clients, method)
    assert_dicts_close(agg.delta, own, size, times=2)
    if method != "flora":
        assert_dicts_close(served(agg, 4, 16.0), own, size, times=2, truncated=method == "flexlora")
    for d in agg.delta.values():
        assert d.dtype == torch.float32


@pytest.mark.parametrize("method", ["zeropad", "hetlora", "flexlora", "flora"])
def test_one_update_in_different_ranks_and_alphas_aggregates_to_itself(method):
    """A rank-2 adapter, the same update zero-padded to rank 4 under another alpha, and to rank 8."""
    small = client(2, 4.0, seed=3)  # s = 2
    clients = [small]
    for rank, alpha, w in ((4, 2.0, 2.0), (8, 24.0, 5.0)):
        s = alpha / rank
        A = {n: torch.nn.functional.pad(a, (0, 0, 0, rank - 2)) for n, a in small.A.items()}
        B = {n: torch.nn.functional.pad(b * 2.0 / s, (0, rank - 2)) for n, b in small.B.items()}
        clients.append(ClientLoRA(A, B, alpha, w))
    own = {n: effective_delta(small.A[n], small.B[n], 4.0) for n in SHAPES}
    size = magnitude([small])  # (the rank-8 copy's B carries one more rounding: b * 2 / 3)
    agg = aggregate_lora(clients, method)
    assert_dicts_close(agg.delta, own, size, times=2)
    if method != "flora":
        for rank, alpha in ((2, 4.0), (8, 1.0)):
            assert_dicts_close(served(agg, rank, alpha), own, size, times=2, truncated=method == "flexlora")


def test_hetlora_gives_a_zero_adapter_zero_weight():
    clients = hetero()
    zero = client(4, 4.0, weight=1000.0, seed=9)
    zero.B = {n: torch.zeros_like(b) for n, b in zero.B.items()}  # the LoRA init: A random, B zero
    with_zero = aggregate_lora([*clients[:2], zero, *clients[2:]], "hetlora")
    without = aggregate_lora(clients, "hetlora")
    assert_dicts_close(with_zero.delta, without.delta, product_size(without.A, without.B), times=2)


def test_hetlora_weights_are_the_update_norms():
    clients = hetero()
    agg = aggregate_lora(clients, "hetlora")
    for n in SHAPES:
        norms = [c.weight * torch.linalg.matrix_norm(c.scale * c.B[n].double() @ c.A[n].double()) for c in clients]
        q = [float(x / sum(norms)) for x in norms]
        assert_padded_mean(agg.delta[n], clients, q, n)


def test_fedavg_serves_only_its_rank():
    agg = aggregate_lora([client(4, 8.0, seed=k) for k in range(3)], "fedavg")
    with pytest.raises(ValueError, match="fedavg aggregated rank 4 adapters and cannot serve rank 2"):
        agg.for_client(2, 8.0)
    assert_dicts_close(served(agg, 4, 2.0), agg.delta, product_size(agg.A, agg.B, agg.scale), times=2)  # another
    # alpha: B rescaled, same update


def _bad(mutate) -> list[ClientLoRA]:
    clients = hetero()
    mutate(clients)
    return clients


def _set(clients: list[ClientLoRA], k: int, attr: str, value: float) -> None:
    setattr(clients[k], attr, value)


def _poke(clients: list[ClientLoRA], k: int, factor: str, name: str, value: float) -> None:
    getattr(clients[k], factor)[name][0, 0] = value


ALLOWED = "fedavg, zeropad, hetlora, flexlora, flora"


@pytest.mark.parametrize(
    "clients, method, message",
    [
        (hetero(), "fedprox", rf"unknown LoRA aggregation method 'fedprox'; use one of {ALLOWED}"),
        ([], "zeropad", "no clients to aggregate"),
        (hetero(), "fedavg", r"fedavg needs one rank and one alpha .* ranks \[8, 4, 2, 1\]"),
        ([client(4, 8.0), client(4, 16.0)], "fedavg", r"fedavg needs .* alphas \[8.0, 16.0\]"),
        (_bad(lambda c: (c[2].A.pop("v_proj"), c[2].B.pop("v_proj"))), "zeropad",
         r"client 2 adapts different modules than client 0: missing \['v_proj'\]"),
        (_bad(lambda c: c[1].A.pop("v_proj")), "zeropad",
         r"client 1: A and B name different modules: .*only in B \['v_proj'\]"),
        (_bad(lambda c: c[1].A.update(v_proj=torch.randn(3, 24))), "zeropad",
         r"client 1: v_proj: A \(3, 24\) and B \(20, 4\) are not \(r, in\) and \(out, r\)"),
        (_bad(lambda c: (c[0].A.update(q_proj=torch.randn(2, 24)), c[0].B.update(q_proj=torch.randn(16, 2)))),
         "flora", "client 0: modules have different ranks"),
        (_bad(lambda c: c[3].A.update(o_proj=torch.randn(1, 17))), "flexlora",
         r"client 3, o_proj: \(out, in\) = \(24, 17\) but client 0 has \(24, 16\)"),
        (_bad(lambda c: _poke(c, 1, "A", "q_proj", math.nan)), "hetlora", "client 1, q_proj: A or B holds NaN or Inf"),
        (_bad(lambda c: _poke(c, 2, "B", "o_proj", math.inf)), "flora", "client 2, o_proj: A or B holds NaN or Inf"),
        (_bad(lambda c: _set(c, 1, "weight", 0.0)), "zeropad", "client 1: weight must be positive and finite, got 0.0"),
        (_bad(lambda c: _set(c, 0, "weight", -2.0)), "flexlora", "client 0: weight must be positive and finite"),
        (_bad(lambda c: _set(c, 3, "weight", math.nan)), "flora", "client 3: weight must be positive and finite"),
        (_bad(lambda c: _set(c, 2, "alpha", 0.0)), "hetlora", "client 2: alpha must be positive and finite"),
    ],
    ids=["unknown-method", "empty", "fedavg-ranks", "fedavg-alphas", "module-names", "a-b-names", "a-b-shapes",
         "ranks-per-module", "out-in", "nan", "inf", "zero-weight", "negative-weight", "nan-weight", "zero-alpha"],
)
def test_bad_input_raises_a_clear_error(clients, method, message):
    with pytest.raises(ValueError, match=message):
        aggregate_lora(clients, method)


def test_flora_stack_validates_too():
    with pytest.raises(ValueError, match="no clients to aggregate"):
        flora_stack([])


@pytest.mark.parametrize(
    "rank, alpha, message",
    [(0, 8.0, "rank must be a positive int"), (2.0, 8.0, "rank must be"), (4, 0.0, "alpha must be"), (4, math.inf, "alpha")],
)
def test_for_client_rejects_bad_rank_or_alpha(rank, alpha, message):
    agg = aggregate_lora(hetero(), "zeropad")
    with pytest.raises(ValueError, match=message):
        agg.for_client(rank, alpha)


def test_effective_delta_rejects_mismatched_factors():
    with pytest.raises(ValueError, match=r"A \(4, 8\) and B \(6, 3\)"):
        effective_delta(torch.zeros(4, 8), torch.zeros(6, 3), 8.0)


def test_a_merged_update_goes_as_factors_while_smaller_and_as_their_product_after():
    g = torch.Generator().manual_seed(0)
    low = (torch.randn(3, 64, generator=g), torch.randn(48, 3, generator=g))  # 3 * (64 + 48) < 64 * 48
    high = (torch.randn(40, 64, generator=g), torch.randn(48, 40, generator=g))  # 40 * 112 > 3072
    wire = merged_arrays({"low": low[0], "high": high[0]}, {"low": low[1], "high": high[1]})
    assert set(wire) == {"low.merged_A", "low.merged_B", "high.merged_W"}
    assert wire["low.merged_A"] is low[0] and wire["low.merged_B"] is low[1]
    assert_product_within_bound(wire["high.merged_W"], high[1], high[0])  # float32: gamma_40 |B| |A| (fp_bounds)
    assert sum(t.numel() for t in wire.values()) <= 2 * 64 * 48  # never more than dense, module by module


def test_flexlora_svd_from_the_factors_is_the_dense_svd_sign_for_sign():
    """The SVD flexlora runs on the stacked factors is the dense update's, each component with the same sign (the
    largest entry of U's column positive), so what a client is served does not depend on which one ran: within
    the float64 QRs' and SVDs' backward errors moved by the singular gaps (Wedin), and the components past the
    factors' rank are absent."""
    from fedfusion.fusion.lora.aggregate import dense_svd, factored_svd

    g = torch.Generator().manual_seed(5)
    A, B = torch.randn(6, 40, generator=g, dtype=torch.float64), torch.randn(30, 6, generator=g, dtype=torch.float64)
    (U, S, Vh), (u, s, vh) = factored_svd(A, B), dense_svd(B @ A)
    assert U.shape == (30, 6) and Vh.shape == (6, 40) and s.shape == (30,)
    gaps = torch.cat([S[:1], S[:-1] - S[1:]]).minimum(torch.cat([S[:-1] - S[1:], S[-1:]]))
    backward = gamma(40 * 40, torch.float64) * float(torch.linalg.matrix_norm(B) * torch.linalg.matrix_norm(A))
    assert_within(S, s[:6], 2 * backward)  # Weyl
    angle = 4 * backward / gaps  # per component: each vector within its rotation bound
    assert_within(U, u[:, :6], angle.expand(30, 6))
    assert_within(Vh, vh[:6], angle[:, None].expand(6, 40))
    assert (U.gather(0, U.abs().argmax(0, keepdim=True)) > 0).all()
    flipped = factored_svd(-A, -B)  # the same product from factors of the other sign: the same components
    assert_within(flipped[0], U, angle.expand(30, 6))
    assert_within(flipped[2], Vh, angle[:, None].expand(6, 40))
