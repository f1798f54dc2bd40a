"""Secure aggregation (privacy.secure_aggregation): masks that cancel in the sum and hide each vector, the protocol's
steps between FusionStrategy and the clients' side over a grid that runs them in process, dropouts unmasked from the
others' shares, a client that refuses to reveal both secrets of one peer, and a fold equal to the plain one up to the
fixed point and float32 sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedfusion.clients import secagg as client
from fedfusion.strategies import FusionStrategy
from fedfusion.strategies.secagg import SecureAggregation
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from fp_bounds import assert_within, gamma
from transformers import LlamaForCausalLM

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.wire import secagg as sa
from fedfusion.wire.keys import FROZEN, NUM_EXAMPLES
from fedfusion.wire.quantize import Wire, decode, unpack_index
from fedfusion.wire.specs import Caps, SecAggSpec
from tests.conftest import tiny_config
from tests.test_strategy import new_strategy


@pytest.fixture(autouse=True)
def task_identity():
    """Messages built outside a Flower runtime need a run/task identity (Flower sets it in a real run)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def masked_clients(n: int, size: int, sd: float, seed: int) -> tuple[list, list, list, dict, list]:
    """``n`` clients' random updates, their mask secrets, self-mask seeds, mask public keys and masked vectors."""
    rng = np.random.default_rng(seed)
    updates = [rng.normal(0, sd, size) for _ in range(n)]
    keys = [sa.new_keys() for _ in range(n)]
    seeds = [sa.new_seed() for _ in range(n)]
    publics = {i: keys[i][1] for i in range(n)}
    masked = [sa.masked(sa.encode(u), i, seeds[i], keys[i][0], publics) for i, u in enumerate(updates)]
    return updates, [k[0] for k in keys], seeds, publics, masked


def fixed_point_bound(n: int, exact: np.ndarray) -> float:
    """How far the decoded sum of ``n`` encoded vectors may be from their exact sum: half a unit of 2**-32 per
    vector, and the float64 conversions and sums of the reference (a few ulps of its largest value)."""
    return n * 2.0 ** -33 + 4 * n * np.finfo(np.float64).eps * float(np.abs(exact).max())


def test_pairwise_masks_cancel_in_the_sum_and_hide_each_vector():
    n = 4
    updates, _, seeds, publics, masked = masked_clients(n, 20_000, 0.05, 0)
    total = np.zeros(20_000, dtype=np.uint64)
    for m in masked:
        total += m
    unmasked = sa.unmask(total, dict(enumerate(seeds)), {}, publics, range(n))
    exact = sum(updates)
    assert np.abs(sa.decode(unmasked) - exact).max() <= fixed_point_bound(n, exact)
    for u, m in zip(updates, masked):  # one masked vector says nothing of its update: uniform modulo 2**64
        assert abs(np.corrcoef(sa.decode(m), u)[0, 1]) < 0.05  # |corr| of independent vectors: ~1/sqrt(size) = 0.007


def test_a_dropped_clients_pairwise_masks_come_off_with_its_rebuilt_secret():
    updates, secrets, seeds, publics, masked = masked_clients(3, 1000, 1.0, 1)
    total = masked[0] + masked[2]  # client 1 masked with the others, then dropped
    out = sa.unmask(total, {0: seeds[0], 2: seeds[2]}, {1: secrets[1]}, publics, [0, 2])
    exact = updates[0] + updates[2]
    assert np.abs(sa.decode(out) - exact).max() <= fixed_point_bound(2, exact)


def test_fixed_point_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match="NaN or Inf"):
        sa.encode(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="over the fixed point's range"):
        sa.encode(np.array([sa.LIMIT]))


def test_sealed_shares_open_only_for_their_pair():
    a, b, c = sa.new_keys(), sa.new_keys(), sa.new_keys()
    key_ab = sa.fernet_key(a[0], b[1])
    assert key_ab == sa.fernet_key(b[0], a[1])
    sealed = sa.seal(key_ab, 0, 1, b"mask-share", b"seed-share")
    assert sa.open_sealed(sa.fernet_key(b[0], a[1]), sealed, 0, 1) == (b"mask-share", b"seed-share")
    with pytest.raises(ValueError, match="do not decrypt"):
        sa.open_sealed(sa.fernet_key(c[0], a[1]), sealed, 0, 1)
    with pytest.raises(ValueError, match="arrived as"):
        sa.open_sealed(key_ab, sealed, 0, 2)


# -- the protocol between FusionStrategy and the clients' side --------------------------------------------------------
DEVICES = {11: "phone", 12: "desktop", 13: "phone", 14: "laptop"}


def change_of(node: int, name: str, value: torch.Tensor) -> torch.Tensor:
    """What node ``node``'s fake training adds to a tensor: a fixed function of node and tensor."""
    gen = torch.Generator().manual_seed(node * 1000 + sum(map(ord, name)))
    return 0.01 * torch.randn(value.shape, generator=gen)


class ClientGrid:
    """Four nodes played in process: the capability query, secure aggregation's steps (fedfusion.clients.secagg)
    and training (secagg_mod around a fake training that adds :func:`change_of`); ``drop`` nodes fail training."""

    def __init__(self, drop: tuple[int, ...] = (), lie: bool = False) -> None:
        self.drop, self.lie = drop, lie
        self.contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in DEVICES}
        self.seen: list[Message] = []  # every reply the server got

    def get_node_ids(self) -> list[int]:
        return list(DEVICES)

    def train(self, msg: Message, context: Context) -> Message:
        node = msg.metadata.dst_node_id
        if node in self.drop:
            return Message(Error(code=1, reason="RuntimeError: injected crash"), reply_to=msg)
        sent = decode(msg.content["arrays"].to_torch_state_dict(), keep=FROZEN)
        trained = {k: v + change_of(node, k, v) for k, v in sent.items() if not k.startswith(FROZEN)}
        metrics = MetricRecord({NUM_EXAMPLES: 10 + node, "train_loss": 1.0, "train_s": 0.1})
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msg)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
            context = self.contexts[node]
            if kind == "query":
                caps = Caps(DEVICES[node], node, 10 + node).to_config()
                replies.append(Message(RecordDict({"caps": ConfigRecord(caps)}), reply_to=msg))
            elif kind == "query.secagg":
                spec = SecAggSpec.from_config(msg.content["config"])
                if self.lie and spec.stage == "unmask":  # a server that says a survivor dropped
                    config = msg.content["config"]
                    config["secagg-dropped"] = config["secagg-peers"]
                try:
                    replies.append(client.query(msg, context))
                except ValueError as exc:
                    replies.append(Message(Error(code=1, reason=str(exc)), reply_to=msg))
            else:
                replies.append(client.secagg_mod(msg, context, self.train))
        self.seen += replies
        return replies


def make_strategy(secure: bool, weighting: str = "examples", forward: str = "slice") -> tuple[FusionStrategy, dict]:
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    widths = {"phone": 0.25, "laptop": 0.5, "desktop": 0.5}
    method = SubModelMethod(cfg, widths, state, policy="rolling", stride=0.25, stagger=True, forward=forward,
                            wire=Wire("float16"))
    strategy = new_strategy(
        dict.fromkeys(widths, method), clients_per_round=4, query_config={"population": "{}"},
        participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0, weighting=weighting,
        secure=SecureAggregation(weighting) if secure else None,
    )
    return strategy, state


def run_round(strategy: FusionStrategy, state: dict, grid: ClientGrid) -> dict | None:
    messages = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    return None if arrays is None else arrays.to_torch_state_dict()


def fold_bound(strategy: FusionStrategy, state: dict, replies: int) -> dict[str, torch.Tensor]:
    """Per coordinate, how far the plain and the secure fold may differ: both sum at most ``replies`` weighted
    float32 terms of magnitude (start + change) / scale (gamma_{2 replies + 8}, the changes' float32 subtraction and the
    conversions included), and the secure sum carries half a unit of 2**-32 per reply; over the coordinate's weight."""
    method = strategy.run.fold_order[0]
    sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
    counts = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
    for node, payload in strategy.run.round.payloads.items():
        row = strategy.run.round.rows[node]
        if row.status != "ok":
            continue
        layout = method.secure_layout(payload)
        sent = decode(method.wire(method.wire.exact(extract_slice(method, payload))))
        index = unpack_index(layout[sa.INDEX_KEY], list(sent))
        scales = dict(zip(sorted(sent), layout[sa.SCALES_KEY].tolist()))
        names = method.secure_names(state)
        shapes = sa.unpack_shapes(layout[sa.SHAPES_KEY])
        size = {k: (v.abs() + change_of(node, k, v).abs() + v.abs()) for k, v in sent.items()}
        ones = {k: torch.ones_like(v) for k, v in sent.items()}
        for name, value in sa.unflatten(client.padded(size, index, scales, shapes, row.examples), names, shapes).items():
            sums[name] += value.double()
        for name, value in sa.unflatten(client.padded(ones, index, scales, shapes, row.examples), names, shapes).items():
            counts[name] += value.double().abs()
    bound = {}
    for name in sums:
        weight = counts[name].clamp_min(1e-300)
        bound[name] = (gamma(2 * replies + 8, torch.float32) * sums[name] + replies * 2.0 ** -33 / weight) * 1.01
    return bound


def extract_slice(method: SubModelMethod, payload) -> dict:
    from fedfusion.models.slicing import extract

    plan, target, _ = payload.context
    return extract(target, method.config, plan)


@pytest.mark.parametrize("forward", ["slice", "full"])
def test_the_secure_fold_equals_the_plain_one_and_the_server_holds_only_masked_vectors(forward):
    plain, state = make_strategy(False, forward=forward)
    want = run_round(plain, state, ClientGrid())
    secure, _ = make_strategy(True, forward=forward)
    grid = ClientGrid()
    got = run_round(secure, state, grid)
    assert got is not None and want is not None
    assert all(r.status == "ok" for r in secure.run.round.rows.values()) and len(secure.run.round.rows) == 4
    bound = fold_bound(secure, state, 4)
    moved = 0
    for name in want:
        assert_within(got[name], want[name], bound.get(name, 0.0))
        moved += int((want[name] != state[name]).sum())
    assert moved > 0
    # what the server received: keys, sealed shares, masked vectors, shares; never a trained array
    trained = [r for r in grid.seen if "arrays" in r.content and "metrics" in r.content]
    assert len(trained) == 4 and all(set(r.content["arrays"].keys()) == {sa.MASKED_KEY} for r in trained)
    assert "secagg_s" in secure.run.round.server_cost
    assert all(row.extra["secagg_bytes"] > 0 for row in secure.run.round.rows.values())


def test_a_client_that_drops_after_the_keys_is_unmasked_from_the_others_shares():
    plain, state = make_strategy(False)
    secure, _ = make_strategy(True)
    got = run_round(secure, state, ClientGrid(drop=(12,)))
    want = run_round(plain, state, ClientGrid(drop=(12,)))
    assert got is not None and want is not None
    assert secure.run.round.rows[12].status == "failed"
    bound = fold_bound(secure, state, 3)
    for name in want:
        assert_within(got[name], want[name], bound.get(name, 0.0))


def test_too_few_survivors_void_the_round_and_a_lying_server_gets_no_shares(caplog):
    secure, state = make_strategy(True)
    assert run_round(secure, state, ClientGrid(drop=(11, 12, 13))) is None  # 1 survivor < threshold 3
    assert secure.run.round.void
    assert "fewer than secure aggregation's threshold 3" in caplog.text
    secure, state = make_strategy(True)
    grid = ClientGrid(lie=True)
    assert run_round(secure, state, grid) is None  # every client refuses to reveal both secrets of a survivor
    assert "refused to unmask" in caplog.text and secure.run.round.void


def test_a_malformed_masked_reply_is_rejected_and_the_rest_still_unmask(caplog):
    class Short(ClientGrid):
        def send_and_receive(self, messages, timeout=None):
            replies = super().send_and_receive(messages, timeout)
            for r in replies:
                if r.metadata.src_node_id == 13 and "metrics" in r.content:
                    r.content["arrays"] = ArrayRecord({sa.MASKED_KEY: Array(np.zeros(5, dtype=np.uint64))})
            return replies

    plain, state = make_strategy(False)
    secure, _ = make_strategy(True)
    got = run_round(secure, state, Short())
    assert secure.run.round.rows[13].status == "rejected" and "masked vector must be" in secure.run.round.rows[13].error
    want = run_round(plain, state, ClientGrid(drop=(13,)))
    bound = fold_bound(secure, state, 3)
    for name in want:
        assert_within(got[name], want[name], bound.get(name, 0.0))


@pytest.mark.parametrize("override, message", [
    ("fusion.aggregate=median", "fusion.aggregate must be mean"),
    ("fusion.wire_up=int8", "fusion.wire_up must be float32"),
    ("selection.clients_per_round=1", "clients_per_round must be >= 2"),
    ("fusion.method=distill", "every tier must train fusion.method=submodel"),
])
def test_a_recipe_secure_aggregation_cannot_serve_is_one_error(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("quickstart", ["privacy.secure_aggregation=true", override])


def test_the_support_travels_as_runs_and_comes_back_as_its_positions():
    held = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    runs = sa.pack_support(held)
    assert runs.tolist() == [1, 3, 5, 6, 7, 10]
    assert sa.unpack_support(runs).tolist() == held.nonzero().flatten().tolist()
    assert sa.unpack_support(sa.pack_support(torch.zeros(4, dtype=torch.bool))).size == 0


@pytest.mark.slow  # Flower's simulation engine
@pytest.mark.parametrize("mode", ["none", "dp_sgd"])
def test_a_flower_run_with_secure_aggregation_sends_only_masked_vectors(tmp_path, mode):
    """Through Flower's simulation engine (each step a message to a Ray actor, the node's secrets in its
    ``context.state`` between them): every sampled client trains, each round's replies are masked vectors of one
    length (8 bytes per coordinate of the round's support), and the ledger holds the extra steps' bytes and seconds;
    with DP-SGD on the devices too (the update masked is the DP-trained one), each client's epsilon is accounted
    within its budget. The report says what the server held and, with DP, what was spent."""
    import json

    from fedfusion.cli import main

    out = tmp_path / "run"
    dp = ["privacy.mode=dp_sgd", "privacy.epsilon=50", "privacy.noise_multiplier=0"] if mode == "dp_sgd" else []
    assert main(["run", "quickstart", "privacy.secure_aggregation=true", *dp, "rounds=2", "population.num_clients=4",
                 "selection.clients_per_round=3", "train.local_steps=2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["status"] == "ok" and r["secagg_bytes"] > 0 for r in rows)
    for round_ in (1, 2):
        sizes = {r["bytes_up"] for r in rows if r["round"] == round_}
        assert len(sizes) == 1  # one vector length a round, whatever slice each client trained
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics if "secagg_s" in m] == [1, 2]
    report = (out / "report.md").read_text()
    assert "Secure aggregation: each round the server folded the sum" in report
    if mode == "none":
        assert metrics[-1]["eval_ppl"] < metrics[0]["eval_ppl"]
        assert "Privacy: DP-SGD" not in report
    else:
        assert all(0 < r["epsilon"] <= 50 for r in rows) and "Privacy: DP-SGD on every device" in report
