"""FusionStrategy driving heterogeneous-rank LoRA (LoRAMethod) on hand-built Flower Messages and on in-process
clients over a tiny base (no Ray)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from fedfusion.strategies import FusionStrategy
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from fp_bounds import assert_within, gamma, unit_roundoff
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from fedfusion.config.choices import LORA_METHODS
from fedfusion.data.instruct import pooled_held_out
from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.lora.aggregate import (
    ClientLoRA,
    aggregate_lora,
    compress_factors,
    effective_delta,
    from_global,
    global_factors,
    serve,
)
from fedfusion.fusion.lora.method import (
    LoRAMethod,
    adapted_modules,
    apply_global,
    save_adapter,
    save_merged,
    snapshot,
    split_global,
)
from fedfusion.fusion.lora.spec import LoRABaseSpec
from fedfusion.models.pretrained import load_base_tokenizer
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.train.instruct import encode_pairs, evaluate_instruct
from fedfusion.wire.specs import Caps, ClientSpec, FaultSpec, PrivacySpec, TrainSpec, merge
from tests.conftest import LazyModule
from tests.test_lora import ROUNDINGS
from tests.test_lora_client import DATA, MODULES, assert_layer_adds, recording, save_tiny_base
from tests.test_strategy import new_strategy

# the LoRA role imports peft and bitsandbytes (seconds): on first use, not at collection, and on one xdist worker only
client = LazyModule("fedfusion.clients.lora")
adapters = LazyModule("fedfusion.models.adapters")
pytestmark = pytest.mark.xdist_group("peft")

RANKS = {"phone": 2, "laptop": 4, "desktop": 8}
ALPHAS = {"phone": 4.0, "laptop": 8.0, "desktop": 8.0}
QUANT = {"phone": 4, "laptop": 8, "desktop": 0}
DEVICES = {11: "phone", 12: "laptop", 13: "desktop"}


def assert_update(b: torch.Tensor, a: torch.Tensor, want: torch.Tensor, truncated: bool = False,
                  inputs: tuple[torch.Tensor, torch.Tensor] | None = None, cut: bool = False) -> None:
    """``b @ a`` (float32 factors, the product taken in float64) is the update ``want`` (float64): within twice the
    aggregation's float32 roundings (tests/test_lora.py's ROUNDINGS) of ``|b| |a| + |want|``; the float64 QR and
    SVD's backward error, ``gamma_{n^2}`` of ``||B||_F ||A||_F`` (``inputs``: the factors they ran on, else ``b, a``);
    with ``cut`` (compress_factors, flexlora's global factors) the numerical-rank cut at 1e-6 of the largest
    singular value (``sqrt(n)`` of those, Frobenius); and with
    ``truncated`` (a truncated SVD of a float32 update whose trailing singular values are its rounding noise) Weyl's
    ``2 ||E||_F`` of that noise."""
    b64, a64, want = b.double(), a.double(), want.double()
    size = b64.abs() @ a64.abs() + want.abs()
    fb, fa = (t.double() for t in (inputs or (b, a)))
    n = min(want.shape)
    sigma = float(torch.linalg.matrix_norm(want, ord=2))
    slack = gamma(n * n, torch.float64) * float(torch.linalg.matrix_norm(fb) * torch.linalg.matrix_norm(fa)) \
        + (n ** 0.5 * 1e-6 * sigma if cut else 0.0)
    bound = 2 * ROUNDINGS * size + slack
    if truncated:
        bound = bound + 2 * ROUNDINGS * float(torch.linalg.matrix_norm(size))
    assert_within(b64 @ a64, want, bound)


@pytest.fixture(autouse=True)
def task_identity():
    """Messages built outside a Flower runtime need a run/task identity (Flower sets it in a real run)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny base; quantised copies go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDFUSION_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield save_tiny_base(tmp_path_factory.mktemp("base") / "tiny")


@pytest.fixture(scope="module")
def shapes(base):
    return adapted_modules(LlamaForCausalLM.from_pretrained(base), list(MODULES))


class FakeGrid:
    """Nodes that answer the capability query with their device; ``train=True`` also trains in process
    with the real LoRA client role."""

    def __init__(self, devices: dict[int, str], train: bool = False) -> None:
        self.devices, self.train, self.sent = devices, train, []

    def get_node_ids(self) -> list[int]:
        return list(self.devices)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            self.sent.append(m)
            if m.metadata.message_type == MessageType.QUERY:
                content = RecordDict({"caps": ConfigRecord(Caps(self.devices[node], node - 11, 1).to_config())})
            elif m.metadata.message_type == MessageType.EVALUATE:
                metrics = client.evaluate(m.content["arrays"].to_torch_state_dict(), m.content["config"], node - 11)
                content = RecordDict({"metrics": MetricRecord(metrics)})
            elif self.train:
                arrays, metrics = client.train(m.content["arrays"].to_torch_state_dict(), m.content["config"], node - 11)
                content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)})
            else:
                continue
            replies.append(Message(content, reply_to=m))
        return replies


def make(shapes, method="flexlora", base="unused", min_clients=1, ranks=RANKS, alphas=ALPHAS, **train) -> FusionStrategy:
    lora = LoRAMethod(modules=shapes, ranks=ranks, alphas=alphas, quantize=QUANT, method=method, base_params=1000,
                      base=LoRABaseSpec(base, "float32", tuple(MODULES), 0.0))
    config = {**merge(ClientSpec(DATA, 96, 1), TrainSpec(2, 1e-2, 4, 0.0, "adamw"), FaultSpec(),
                      PrivacySpec("none", 1.0, 10.0, 1e-5)), "seed": 0, **train}
    return new_strategy({tier: lora for tier in ranks}, clients_per_round=3, min_clients=min_clients,
                          query_config={"population": "{}"}, weighting="examples",
                          participation=Participation(make_selector("random", seed=0), load_catalog()),
                          train_config=config, wait_nodes_s=0.0)  # a FakeGrid's nodes are all there: no waiting


def random_client(shapes, rank, alpha, weight, seed) -> ClientLoRA:
    g = torch.Generator().manual_seed(seed)
    return ClientLoRA({m: 0.3 * torch.randn(rank, i, generator=g) for m, (_, i) in shapes.items()},
                      {m: 0.3 * torch.randn(o, rank, generator=g) for m, (o, _) in shapes.items()}, alpha, weight)


def reply(msg: Message, arrays: dict | None, n: int = 10, error: str | None = None) -> Message:
    if error:
        return Message(Error(code=1, reason=error), reply_to=msg)
    metrics = MetricRecord({"num-examples": n, "train_loss": 1.5, "train_s": 0.1})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)


def as_arrays(c: ClientLoRA) -> dict[str, torch.Tensor]:
    return {**{f"{m}.lora_A": a for m, a in c.A.items()}, **{f"{m}.lora_B": b for m, b in c.B.items()}}


# -- the math added to fedfusion.fusion.lora.aggregate for the Flower layer ------------------------------------------------
def test_compress_factors_is_exact_and_keeps_only_the_numerical_rank():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 20, generator=g).repeat(4, 1)  # 12 rows spanning 3 directions
    B = torch.randn(16, 12, generator=g)
    a, b = compress_factors(A, B)
    assert a.shape == (3, 20) and b.shape == (16, 3)
    assert_update(b, a, B.double() @ A.double(), inputs=(B, A), cut=True)
    a, b = compress_factors(torch.zeros(2, 5), torch.zeros(4, 2))
    assert a.shape == (1, 5) and not (b @ a).any()
    with pytest.raises(ValueError, match="not \\(r, in\\)"):
        compress_factors(torch.zeros(2, 5), torch.zeros(4, 3))


@pytest.mark.parametrize("method", LORA_METHODS)
def test_global_factors_carry_the_aggregate_and_serve_every_rank(method, shapes):
    ranks = [4, 4, 4] if method == "fedavg" else [8, 4, 2]
    alphas = [8.0, 8.0, 8.0] if method == "fedavg" else [8.0, 8.0, 4.0]
    clients = [random_client(shapes, r, a, w, s) for s, (r, a, w) in enumerate(zip(ranks, alphas, [1.0, 2.0, 3.0]))]
    agg = aggregate_lora(clients, method)
    merged = (({m: torch.randn(3, i) for m, (_, i) in shapes.items()},
               {m: torch.randn(o, 3) for m, (o, _) in shapes.items()}) if method == "flora" else None)
    A, B = global_factors(agg, merged)
    served = from_global(method, A, B)
    for m in shapes:
        want = agg.delta[m].double() + (merged[1][m].double() @ merged[0][m].double() if merged else 0)
        assert_update(B[m], A[m], want, cut=method in ("flexlora", "flora"))
        # the served update: that product rounded to float32 once more
        assert_within(served.delta[m], B[m].double() @ A[m].double(), ROUNDINGS * (B[m].double().abs() @ A[m].double().abs()))
    if method == "flora":
        assert serve(served, 4, 8.0) is None  # fresh adapters on the merged base
        return
    rank, alpha = (4, 8.0) if method == "fedavg" else (16, 8.0)  # 16 > the 8 components zeropad holds
    a, b = serve(served, rank, alpha)
    for m in shapes:
        if method == "flexlora":  # the best rank-16 approximation of a rank-14 update is the update: all 14
            assert a[m].shape[0] == 14  # components of its global factors (the client adds 2 fresh ones)
        # the client's own scaling, whatever k <= rank it was served
        assert_update(alpha / rank * b[m], a[m], agg.delta[m], truncated=method == "flexlora", cut=method == "flexlora")


# -- the strategy on hand-built replies -------------------------------------------------------------------
def test_each_node_gets_its_tier_rank_alpha_and_precision_in_its_own_message(shapes):
    strategy = make(shapes)
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({}), FakeGrid(DEVICES)))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 12, 13]
    assert len({id(m.content) for m in msgs}) == 3
    for m in msgs:
        spec, tier = m.content["config"], DEVICES[m.metadata.dst_node_id]
        assert (spec["role"], spec["rank"], spec["alpha"], spec["quantize"]) == ("lora", RANKS[tier], ALPHAS[tier], QUANT[tier])
        assert spec["target-modules"] == "q_proj,v_proj" and spec["method"] == "flexlora"
        sent = m.content["arrays"].to_torch_state_dict()  # round 1: the whole fresh adapter, A then B per module
        assert list(sent) == [f"{mod}.lora_{x}" for mod in shapes for x in "AB"]
        for mod, (o, i) in shapes.items():
            assert sent[f"{mod}.lora_A"].shape == (RANKS[tier], i) and sent[f"{mod}.lora_A"].abs().sum() > 0
            assert sent[f"{mod}.lora_B"].shape == (o, RANKS[tier]) and not sent[f"{mod}.lora_B"].any()
        row = strategy.run.round.rows[m.metadata.dst_node_id]
        assert row.extra["rank"] == RANKS[tier] and row.extra["adapter_params"] == RANKS[tier] * sum(o + i for o, i in shapes.values())


def test_bad_replies_are_rejected_and_good_ones_aggregate_exactly(shapes):
    strategy = make(shapes, method="hetlora")
    grid = FakeGrid({**DEVICES, 14: "phone", 15: "laptop"})
    strategy.settings = replace(strategy.settings, clients_per_round=5)
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(), ConfigRecord({}), grid)}
    good = {11: random_client(shapes, 2, 4.0, 10, 1), 13: random_client(shapes, 8, 8.0, 30, 2)}
    nan = as_arrays(random_client(shapes, 4, 8.0, 1, 3))
    nan["model.layers.1.self_attn.v_proj.lora_B"][0, 0] = float("nan")
    wrong_rank = as_arrays(random_client(shapes, 3, 4.0, 1, 4))  # a phone must reply rank 2
    arrays, metrics = strategy.aggregate_train(1, [
        reply(msgs[11], as_arrays(good[11]), n=10), reply(msgs[12], nan), reply(msgs[13], as_arrays(good[13]), n=30),
        reply(msgs[14], wrong_rank), reply(msgs[15], None, error="Traceback ...\nRuntimeError: out of memory"),
    ])
    rows = strategy.run.round.rows
    assert {n: r.status for n, r in rows.items()} == {11: "ok", 12: "rejected", 13: "ok", 14: "rejected", 15: "failed"}
    assert "NaN" in rows[12].error and "expected (2, 64)" in rows[14].error and rows[15].error == "RuntimeError: out of memory"
    assert metrics["clients_ok"] == 2 and metrics["num-examples"] == 40 and strategy.run.round.coverage == 1.0
    A, B = split_global(arrays.to_torch_state_dict())
    want = aggregate_lora([good[11], good[13]], "hetlora")
    for m in shapes:
        assert_update(B[m], A[m], want.delta[m])
    # the next round serves each rank from that global update (zero-padded factors, own scaling)
    nxt = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, arrays, ConfigRecord({}), grid)}
    got = nxt[11].content["arrays"].to_torch_state_dict()
    m = "model.layers.0.self_attn.q_proj"
    assert_within(got[f"{m}.lora_A"], want.A[m][:2], 2 * ROUNDINGS * want.A[m][:2].double().abs())
    b, a = want.B[m][:, :2].double(), want.A[m][:2].double()
    assert_within(effective_delta(got[f"{m}.lora_A"], got[f"{m}.lora_B"], 4.0), b @ a, 2 * ROUNDINGS * (b.abs() @ a.abs()))


def test_a_reply_far_larger_than_the_adapter_sent_is_rejected(shapes):
    strategy = make(shapes, method="zeropad")
    start = random_client(shapes, 8, 1.0, 1.0, 7)
    arrays = ArrayRecord({f"{m}.lora_{x}": t for x, d in (("A", start.A), ("B", start.B)) for m, t in d.items()})
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays, ConfigRecord({}), FakeGrid(DEVICES))}
    served = {n: m.content["arrays"].to_torch_state_dict() for n, m in msgs.items()}
    wild = {k: v * 100 if k.endswith("lora_B") else v for k, v in served[13].items()}
    strategy.aggregate_train(1, [reply(msgs[11], served[11]), reply(msgs[12], served[12]), reply(msgs[13], wild)])
    assert {n: r.status for n, r in strategy.run.round.rows.items()} == {11: "ok", 12: "ok", 13: "rejected"}
    assert "over 10x the norm" in strategy.run.round.rows[13].error


def test_missing_keys_and_too_few_good_replies_leave_the_global_unchanged(shapes):
    strategy = make(shapes, min_clients=2)
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({}), FakeGrid(DEVICES)))
    partial = as_arrays(random_client(shapes, 2, 4.0, 1, 0))
    partial.pop("model.layers.0.self_attn.q_proj.lora_A")
    arrays, metrics = strategy.aggregate_train(1, [reply(msgs[0], partial)])
    assert arrays is None and strategy.run.round.void and metrics["clients_ok"] == 0
    assert "missing ['model.layers.0.self_attn.q_proj.lora_A']" in strategy.run.round.rows[11].error
    assert sorted(r.status for r in strategy.run.round.rows.values()) == ["rejected", "timeout", "timeout"]


def test_flora_sends_the_merged_update_and_fresh_adapters(shapes):
    strategy = make(shapes, method="flora")
    clients = [random_client(shapes, r, ALPHAS[t], 1.0, s) for s, (t, r) in enumerate(RANKS.items())]
    A, B = global_factors(aggregate_lora(clients, "flora"))
    arrays = ArrayRecord({**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": b for m, b in B.items()}})
    for msg in strategy.configure_train(2, arrays, ConfigRecord({}), FakeGrid(DEVICES)):
        got = msg.content["arrays"].to_torch_state_dict()
        assert set(got) == {f"{m}.{kind}_{x}" for m in shapes for x in "AB" for kind in ("merged", "lora")}
        assert not any(got[f"{m}.lora_B"].any() for m in shapes)  # fresh adapters on the merged update
        assert strategy.run.round.rows[msg.metadata.dst_node_id].bytes_down == msg.content["arrays"].count_bytes()


def test_settings_that_cannot_work_are_refused_with_the_key(shapes):
    with pytest.raises(ValueError, match="fedavg needs one rank"):
        make(shapes, method="fedavg")
    with pytest.raises(ValueError, match="lora.method 'svd' is unknown"):
        make(shapes, method="svd")
    with pytest.raises(ValueError, match=r"lora.ranks.desktop must be an int in \[1, 32\]"):
        make(shapes, ranks={**RANKS, "desktop": 64})
    with pytest.raises(ValueError, match="alpha of tier 'phone'"):
        make(shapes, alphas={"laptop": 8.0, "desktop": 8.0})
    with pytest.raises(ValueError, match="match no Linear"):
        adapted_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["q_proj"])


# -- in process: real clients on a tiny base, outputs in peft / Hugging Face format -------------------------
def test_two_rounds_with_real_clients_train_and_save_in_peft_and_hf_format(base, shapes, tmp_path):
    strategy = make(shapes, method="flexlora", base=base, **{"local-steps": 6})
    strategy.settings = replace(strategy.settings, evaluate_clients=1)
    tok = load_base_tokenizer(base)
    held = encode_pairs(tok, pooled_held_out(DATA, 40), 96)
    model = AutoModelForCausalLM.from_pretrained(base)
    original = snapshot(model, shapes)
    losses = []

    def evaluate(server_round, arrays):
        apply_global(model, original, arrays.to_torch_state_dict())
        losses.append(evaluate_instruct(model, held)["eval_loss"])

    grid = FakeGrid(DEVICES, train=True)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2, evaluate_fn=evaluate)
    assert [r.status for r in strategy.run.round.rows.values()] == ["ok"] * 3
    assert losses[-1] < losses[0] - 0.1
    # federated evaluation: the node scored base + global update on its own held-out pairs
    evaluated = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE]
    assert len(evaluated) == 2 and set(evaluated[-1].content["arrays"]) == {f"{m}.merged_{x}" for m in shapes for x in "AB"}
    msg = evaluated[-1]
    partition, bits = msg.metadata.dst_node_id - 11, msg.content["config"]["quantize"]
    assert bits == QUANT[DEVICES[msg.metadata.dst_node_id]]  # scored on the base its device holds
    with adapters.merged_update(client.frozen_base(base, bits, "float32"), msg.content["arrays"].to_torch_state_dict()):
        want = evaluate_instruct(client.frozen_base(base, bits, "float32"),
                                 client.client_data(DATA, partition, base, 96, "held_out"))["eval_loss"]
    # the node ran these same operations on the same values: the same loss, bit for bit
    assert strategy.run.round.fed_eval["fed_eval_loss"] == want
    # the global adapter in peft format reproduces the merged model
    save_adapter(result.arrays.to_torch_state_dict(), tmp_path / "adapter", list(MODULES), base)
    merged = save_merged(model, original, result.arrays.to_torch_state_dict(), tok, tmp_path / "model")
    ids = torch.randint(100, (2, 12))
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    merged_model = AutoModelForCausalLM.from_pretrained(merged)
    # layer by layer (the logits, downstream of differently associated products, have no bound worth asserting):
    # each adapted layer of either model computes x (W + B A)^T on its own input (tests/test_lora_client.py)
    A, B = split_global(result.arrays.to_torch_state_dict())
    seen_peft, _ = recording({m: peft_model.get_submodule(f"base_model.model.{m}") for m in A})
    seen_merged, _ = recording({m: merged_model.get_submodule(m) for m in A})
    with torch.no_grad():
        peft_model(input_ids=ids)
        merged_model(input_ids=ids)
    for m in A:
        for x, y in (seen_peft[m], seen_merged[m]):
            assert_layer_adds(x, y, original[m], A[m], B[m])
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == base


@pytest.mark.parametrize("method", ["zeropad", "hetlora", "flexlora", "flora"])
def test_a_round_without_learning_leaves_the_global_update_unchanged(method, base, shapes):
    """alpha/r consistency end to end: served at one rank, loaded into peft, replied, aggregated."""
    strategy = make(shapes, method=method, base=base, ranks={"desktop": 4}, alphas={"desktop": 16.0},
                    lr=0.0, **{"local-steps": 1})
    g = torch.Generator().manual_seed(5)
    A = {m: torch.randn(4, i, generator=g) for m, (_, i) in shapes.items()}
    B = {m: 0.1 * torch.randn(o, 4, generator=g) for m, (o, _) in shapes.items()}
    start = ArrayRecord({**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": b for m, b in B.items()}})
    result = strategy.start(grid=FakeGrid({13: "desktop"}, train=True), initial_arrays=start, num_rounds=1)
    A2, B2 = split_global(result.arrays.to_torch_state_dict())
    for m in shapes:  # (served, trained by nothing, replied and aggregated: flexlora's SVD cut, flora's stacking)
        assert_update(B2[m], A2[m], B[m].double() @ A[m].double(), truncated=True, cut=method in ("flexlora", "flora"))


@pytest.mark.parametrize("method", ["hetlora", "flora"])
def test_dp_clipping_bounds_each_lora_clients_adapter_update(method, base, shapes):
    """privacy.mode=clip with LoRA: Flower's fixedclipping_mod clips reply - sent over the whole adapter; FLoRA's
    frozen merged update reaches the client but is left out of the comparison and of the reply."""
    from fedfusion.clients.privacy import privacy_mod
    from flwr.app import Context

    from fedfusion.config.recipe import load_recipe
    from fedfusion.run.federation import privacy_spec

    dp = privacy_spec(load_recipe("quickstart", ["privacy.mode=clip", "privacy.clipping_norm=0.001"]))
    strategy = make(shapes, method=method, base=base, **dp)
    clients = [random_client(shapes, r, ALPHAS[t], 1.0, s) for s, (t, r) in enumerate(RANKS.items())]
    A, B = global_factors(aggregate_lora(clients, method))
    arrays = ArrayRecord({**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": b for m, b in B.items()}})
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    seen, replies = [], []

    def train(m: Message, c: Context) -> Message:
        seen.append(set(m.content["arrays"]))
        got, metrics = client.train(m.content["arrays"].to_torch_state_dict(), m.content["config"],
                                    m.metadata.dst_node_id - 11)
        return Message(RecordDict({"arrays": ArrayRecord(got), "metrics": MetricRecord(metrics)}), reply_to=m)

    for msg in strategy.configure_train(2, arrays, ConfigRecord({}), FakeGrid(DEVICES)):
        sent = msg.content["arrays"].to_torch_state_dict()
        out = privacy_mod(msg, ctx, train)
        assert not out.has_error(), out.error.reason if out.has_error() else ""
        assert seen[-1] == set(sent)  # the client was handed everything, merged update included
        got = out.content["arrays"].to_torch_state_dict()
        assert list(got) == [k for k in sent if ".lora_" in k]
        norm = sum(float(((got[k].double() - sent[k].double()) ** 2).sum()) for k in got) ** 0.5
        # the clip's float32 roundings (tests/test_privacy.py): gamma_{n/2+6} of the bound, u of each clipped value
        n = sum(v.numel() for v in got.values())
        size = sum(float((v.double() ** 2).sum()) for v in got.values()) ** 0.5
        assert abs(norm - 0.001) <= 0.001 * gamma(n // 2 + 6, torch.float32) + unit_roundoff(torch.float32) * size
        replies.append(out)
    strategy.aggregate_train(2, replies)
    assert {r.status for r in strategy.run.round.rows.values()} == {"ok"}


def test_local_dp_noise_is_not_mistaken_for_an_absurd_update(base, shapes):
    """privacy.mode=local: LocalDpMod's noise (sigma ~0.5 per coordinate at the defaults) dwarfs a served
    adapter's norm; the replies must still be accepted from round 2 on, so the norm check is off."""
    from fedfusion.clients.privacy import privacy_mod
    from flwr.app import Context

    from fedfusion.config.recipe import load_recipe
    from fedfusion.run.federation import privacy_spec

    dp = privacy_spec(load_recipe("quickstart", ["privacy.mode=local"]))
    strategy = make(shapes, method="flexlora", base=base, **dp)
    clients = [random_client(shapes, r, ALPHAS[t], 1.0, s) for s, (t, r) in enumerate(RANKS.items())]
    A, B = global_factors(aggregate_lora(clients, "flexlora"))
    arrays = ArrayRecord({**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": 0.01 * b for m, b in B.items()}})
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    def train(m: Message, c: Context) -> Message:
        got, metrics = client.train(m.content["arrays"].to_torch_state_dict(), m.content["config"],
                                    m.metadata.dst_node_id - 11)
        return Message(RecordDict({"arrays": ArrayRecord(got), "metrics": MetricRecord(metrics)}), reply_to=m)

    replies = [privacy_mod(m, ctx, train) for m in strategy.configure_train(2, arrays, ConfigRecord({}), FakeGrid(DEVICES))]
    strategy.aggregate_train(2, replies)
    assert {r.status for r in strategy.run.round.rows.values()} == {"ok"}
    assert make(shapes, method="flexlora").max_norm_ratio == 10.0  # on without local DP


@pytest.mark.parametrize("merged", [False, True])
def test_a_lora_run_writes_the_adapter_and_the_merged_base_only_when_asked(merged, base, tmp_path):
    """The merged model is a whole copy of the base (540 MB for SmolLM2-135M): output.save_merged only."""
    from fedfusion.config.recipe import load_recipe
    from fedfusion.run.targets import lora_target

    recipe = load_recipe("rolling", ["fusion.method=lora", "data.source=chatterbot", f"lora.base={base}",
                                     "lora.eval_pairs=4", "train.seq_len=96", f"output.save_merged={merged}"])
    target, _ = lora_target(recipe)
    modules = adapted_modules(target.model, list(recipe.lora.target_modules))
    arrays = ArrayRecord({**{f"{m}.lora_A": torch.randn(2, i) for m, (o, i) in modules.items()},
                          **{f"{m}.lora_B": torch.randn(o, 2) for m, (o, i) in modules.items()}})
    target.save(tmp_path / "run" / "model", arrays)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "model" / "config.json").is_file() == merged
    assert target.metric_names["eval_acc"] == "next-token accuracy (response tokens)"
