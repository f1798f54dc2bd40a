"""Secure aggregation for heterogeneous-rank LoRA: each client's change travels padded to one shape for every rank
(fedavg's and zeropad's factors padded to the largest rank, flexlora's and flora's change of each module's dense
update), and the server's fold from the unmasked sum gives the global update the plain fold gives, two rounds in a
row (the second starting from served factors), up to float32 roundings and the fixed point."""

from __future__ import annotations

import pytest
import torch
from fedfusion.strategies import FusionStrategy
from fedfusion.strategies.secagg import SecureAggregation
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from fp_bounds import assert_within, gamma

from fedfusion.config.choices import LORA_SECURE_METHODS
from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.lora.aggregate import ClientLoRA, aggregate_sum
from fedfusion.fusion.lora.method import LoRAMethod, split_global
from fedfusion.fusion.lora.spec import LoRABaseSpec
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.wire import secagg as sa
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.quantize import decode
from tests.test_secagg import DEVICES, ClientGrid, change_of, task_identity  # noqa: F401 (an autouse fixture)
from tests.test_strategy import new_strategy

MODULES = {"layers.0.q_proj": (16, 12), "layers.0.v_proj": (8, 12)}
# two float32 results, each a few float32 roundings (the factors' change, the unmasked sum, the aggregate's factors,
# their scaling) and float64 arithmetic on the same magnitudes, then multiplied: per factor, so twice in a product
ROUNDINGS = 2 * 2 * (gamma(6, torch.float32) + gamma(64, torch.float64))


class LoRAGrid(ClientGrid):
    """The four nodes of tests/test_secagg.py, training only the adapter (a flora payload's merged arrays stay)."""

    def train(self, msg: Message, context) -> Message:
        node = msg.metadata.dst_node_id
        sent = decode(msg.content["arrays"].to_torch_state_dict())
        trained = {k: v + change_of(node, k, v) for k, v in sent.items() if k.endswith((".lora_A", ".lora_B"))}
        metrics = MetricRecord({NUM_EXAMPLES: 10 + node, "train_loss": 1.0, "train_s": 0.1})
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msg)


def make_strategy(method: str, secure: bool) -> FusionStrategy:
    ranks = dict.fromkeys(("phone", "laptop", "desktop"), 4) if method == "fedavg" else \
        {"phone": 2, "laptop": 4, "desktop": 8}
    alphas = {"phone": 4.0, "laptop": 8.0, "desktop": 8.0} if method != "fedavg" else dict.fromkeys(ranks, 8.0)
    lora = LoRAMethod(MODULES, ranks, alphas, dict.fromkeys(ranks, 0), method, 1000,
                      LoRABaseSpec("unused", "float32", tuple(MODULES), 0.0))
    return new_strategy(
        dict.fromkeys(ranks, lora), clients_per_round=4, query_config={"population": "{}"},
        participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0, weighting="examples",
        secure=SecureAggregation("examples") if secure else None)


def train_round(strategy: FusionStrategy, server_round: int, state: dict, grid: ClientGrid) -> dict:
    messages = list(strategy.configure_train(server_round, ArrayRecord(state), ConfigRecord({}), grid))
    arrays, _ = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
    assert arrays is not None
    return arrays.to_torch_state_dict()


def magnitudes(strategy: FusionStrategy, method: str) -> dict[str, torch.Tensor]:
    """Per module, the magnitudes the round's global update is a signed sum of: every trained client's starting and
    trained adapter, weighted (``sum p |s B| |A|`` for the dense methods, ``(sum p |s B|) (sum p |A|)`` padded)."""
    rows = [(strategy.run.round.payloads[n], r) for n, r in strategy.run.round.rows.items() if r.status == "ok"]
    total = sum(r.examples for _, r in rows)
    out = {}
    for m, (o, i) in MODULES.items():
        dense, pa, pb = torch.zeros(o, i, dtype=torch.float64), torch.zeros(8, i, dtype=torch.float64), \
            torch.zeros(o, 8, dtype=torch.float64)
        for payload, row in rows:
            a0, b0 = payload.context[f"{m}.lora_A"].double(), payload.context[f"{m}.lora_B"].double()
            node, p, s = row.node, row.examples / total, payload.row["alpha"] / payload.row["rank"]
            a = (a0 + change_of(node, f"{m}.lora_A", a0)).abs() + a0.abs()
            b = (b0 + change_of(node, f"{m}.lora_B", b0)).abs() + b0.abs()
            dense += p * s * b @ a
            pa[: a.shape[0]] += p * a
            pb[:, : b.shape[1]] += p * s * b
        out[m] = dense if method in ("flexlora", "flora") else pb @ pa
    return out


@pytest.mark.parametrize("method", LORA_SECURE_METHODS)
def test_the_secure_lora_fold_gives_the_plain_global_update_two_rounds_running(method):
    plain, secure = make_strategy(method, False), make_strategy(method, True)
    want, got = {}, {}
    for server_round in (1, 2):
        grid = LoRAGrid()
        want = train_round(plain, server_round, want, LoRAGrid())
        got = train_round(secure, server_round, got, grid)
        assert all(r.status == "ok" for r in secure.run.round.rows.values()) and len(secure.run.round.rows) == 4
        # every trained reply the server got is a masked vector of the round's support alone
        trained = [r for r in grid.seen if "metrics" in r.content]
        assert len(trained) == 4 and all(set(r.content["arrays"].keys()) == {sa.MASKED_KEY} for r in trained)
        size = magnitudes(secure, method)
        (wa, wb), (ga, gb) = split_global(want), split_global(got)
        for m in MODULES:
            w, g = wb[m].double() @ wa[m].double(), gb[m].double() @ ga[m].double()
            assert w.abs().max() > 0
            # flexlora and flora keep each update's numerical rank: singular values under 1e-6 of the largest go
            cut = 2 * min(w.shape) ** 0.5 * 1e-6 * float(torch.linalg.matrix_norm(w, ord=2)) \
                if method in ("flexlora", "flora") else 0.0
            # the fixed point: half a unit of 2**-32 per reply and coordinate, over the round's examples; padded
            # factors carry it into the product through each row of B and column of A
            eps = 4 * 2.0 ** -33 / sum(r.examples for r in secure.run.round.rows.values())
            fixed = eps if method in ("flexlora", "flora") else \
                eps * (gb[m].double().abs().sum(1, keepdim=True) + ga[m].double().abs().sum(0, keepdim=True) + 8 * eps)
            assert_within(g, w, ROUNDINGS * (size[m] + wb[m].double().abs() @ wa[m].double().abs()
                                             + gb[m].double().abs() @ ga[m].double().abs()) + cut + fixed)


def test_a_dense_change_is_the_change_of_the_scaled_product_and_sums_to_the_plain_flexlora_update():
    g = torch.Generator().manual_seed(3)
    starts, trained = [], []
    for rank, alpha, weight in [(2, 4.0, 11.0), (8, 8.0, 12.0), (4, 8.0, 13.0)]:
        a0, b0 = {m: torch.randn(rank, i, generator=g) for m, (_, i) in MODULES.items()}, \
            {m: torch.randn(o, rank, generator=g) for m, (o, _) in MODULES.items()}
        starts.append(ClientLoRA(a0, b0, alpha, weight))
        trained.append(ClientLoRA({m: a + 0.1 * torch.randn(a.shape, generator=g) for m, a in a0.items()},
                                  {m: b + 0.1 * torch.randn(b.shape, generator=g) for m, b in b0.items()}, alpha, weight))
    total = {m: torch.zeros(o, i, dtype=torch.float64) for m, (o, i) in MODULES.items()}
    for s, t in zip(starts, trained):
        flat = {**{f"{m}.lora_A": a for m, a in s.A.items()}, **{f"{m}.lora_B": b for m, b in s.B.items()}}
        now = {**{f"{m}.lora_A": a for m, a in t.A.items()}, **{f"{m}.lora_B": b for m, b in t.B.items()}}
        for m, d in sa.dense_change(flat, now, s.scale).items():
            assert_within(d, s.scale * (t.B[m].double() @ t.A[m].double() - s.B[m].double() @ s.A[m].double()),
                          gamma(16, torch.float64) * s.scale * (t.B[m].double().abs() @ t.A[m].double().abs()
                                                                 + s.B[m].double().abs() @ s.A[m].double().abs()))
            total[m] += s.weight * d
    agg = aggregate_sum("flexlora", starts, {m: t.float() for m, t in total.items()})
    weight = sum(c.weight for c in trained)
    for m in MODULES:
        want = sum(c.weight / weight * c.scale * (c.B[m].double() @ c.A[m].double()) for c in trained)
        size = sum(c.weight / weight * c.scale * (c.B[m].double().abs() @ c.A[m].double().abs()
                                                  + s.B[m].double().abs() @ s.A[m].double().abs())
                   for c, s in zip(trained, starts))
        assert_within(agg.delta[m], want, ROUNDINGS * size)


@pytest.mark.parametrize("override, message", [
    ("lora.method=hetlora", "lora.method must be one of fedavg, zeropad, flexlora, flora"),
    ("fusion.wire_dtype=int8", "fusion.wire_dtype must be float32 with LoRA"),
])
def test_a_lora_recipe_secure_aggregation_cannot_serve_is_one_error(override, message):
    lora = ["fusion.method=lora", "data.source=chatterbot", "privacy.secure_aggregation=true"]
    load_recipe("rolling", lora)  # flexlora, float32: it can
    with pytest.raises(RecipeError, match=message):
        load_recipe("rolling", [*lora, override])
    with pytest.raises(ValueError, match="cannot fold lora.method='hetlora'"):
        aggregate_sum("hetlora", [ClientLoRA({"m": torch.ones(1, 2)}, {"m": torch.ones(2, 1)}, 1.0)], {})
