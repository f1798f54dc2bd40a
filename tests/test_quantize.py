"""Bytes on the wire (fedfusion.wire.quantize): the quantiser's round trip, exact downlink folds, error feedback on the
uplink (also across moving slices), and the ClientApp's train handler keeping the residual in context.state."""

from __future__ import annotations

import pytest
import torch
from fedfusion.clients.node import Stateless
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from fp_bounds import assert_within, gamma, unit_roundoff
from transformers import LlamaForCausalLM

from fedfusion.config.choices import CHOICES
from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.fusion.base import Client
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.slicing import extract
from fedfusion.wire import quantize as codec
from fedfusion.wire.quantize import (
    BLOCK,
    WIRE_FORMATS,
    Wire,
    carry,
    client_reply,
    decode,
    dequantize,
    encode,
    encoded_bytes,
    pack_index,
    quantize,
    store,
    unpack_index,
)
from tests.conftest import tiny_config


@pytest.fixture(autouse=True)
def task_identity():
    """Messages built outside a Flower runtime need a run/task identity (Flower sets it in a real run)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def steps_of(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Each value's quantisation step (its block's scale)."""
    return scale.float().repeat_interleave(BLOCK)[:n]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(37, 13), (3, 5, 7), (64, 64), (1, 1)])
def test_round_trip_is_within_half_a_step_of_every_value(bits, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])  # blocks of very different magnitudes
    codes, scale = quantize(x, bits)
    y = dequantize(codes, scale, shape)
    assert y.shape == x.shape and y.dtype == torch.float32
    err = (x - y).abs().flatten()
    # half a step, plus the float32 roundings of x / step (which may tip the code at a half) and of code * step
    u = unit_roundoff(torch.float32)
    assert (err <= steps_of(scale, x.numel()) / 2 + u * (x.abs() + y.abs()).flatten()).all()
    # the bits buy what they should: relative to its block's absmax, int8 keeps ~16x finer steps than int4 (the step
    # is absmax / qmax rounded to float16 and float32, the error at most half of it plus the roundings above)
    top = float(x.abs().max())
    assert float(err.max()) <= top / {8: 254, 4: 14}[bits] * (1 + unit_roundoff(torch.float16) + 2 * u) + 2 * u * top


def test_int4_packs_two_codes_per_byte_and_int8_one():
    x = torch.randn(10, 10)  # 100 values: 2 blocks of 64 after padding
    c8, s8 = quantize(x, 8)
    c4, s4 = quantize(x, 4)
    assert (c8.dtype, c8.numel(), c4.dtype, c4.numel()) == (torch.int8, 128, torch.uint8, 64)
    assert s8.dtype == s4.dtype == torch.float16 and s8.numel() == s4.numel() == 2
    low, high = (c4 & 0x0F).int() - 8, (c4 >> 4).int() - 8
    assert low.abs().max() <= 7 and high.abs().max() <= 7
    # the nibbles are the int4 codes in order: value 2i in the low nibble, 2i + 1 in the high one
    unpacked = torch.stack([low, high], 1).flatten()[:100].float()
    # exact: dequantize is this one product of the code and its block's scale
    assert torch.equal(unpacked * s4.float().repeat_interleave(64)[:100], dequantize(c4, s4, (10, 10)).flatten())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_zero_and_constant_tensors_come_back_exactly(fmt):
    state = {"zero": torch.zeros(8, 9), "const": torch.full((4, 40), -0.37)}
    back = decode(encode(state, fmt))
    assert torch.equal(back["zero"], state["zero"])
    # every value its block's absmax: code qmax, so the value is qmax times the scale, absmax / qmax rounded to float32,
    # then float16, and the product to float32
    bound = (unit_roundoff(torch.float16) + 3 * unit_roundoff(torch.float32)) * state["const"].abs()
    assert_within(back["const"], state["const"], bound)


def test_nan_and_inf_inputs_are_refused_naming_the_key():
    for bad in (float("nan"), float("inf")):
        x = torch.ones(4, 4)
        x[1, 2] = bad
        with pytest.raises(ValueError, match="layer.weight: cannot quantise NaN or Inf"):
            encode({"layer.weight": x}, "int8")


def test_a_malformed_quantised_message_is_refused_naming_the_key():
    good = encode({"w": torch.randn(6, 6)}, "int4")
    for broken, match in (
        ({**good, "w::q": good["w::q"][:-1]}, "w: 31 codes \\(torch.uint8\\)"),
        ({**good, "w::scale": good["w::scale"].float()}, "w: scales must be finite float16"),
        ({**good, "w::q": good["w::q"].int()}, "w: codes must be int8 or uint8"),
        ({k: v for k, v in good.items() if k != "w::shape"}, "w: quantised codes without"),
        ({**good, "x::scale": good["w::scale"]}, "x::scale: no codes"),
        ({**good, "w::scale": torch.tensor([float("inf")], dtype=torch.float16)}, "finite"),
    ):
        with pytest.raises(ValueError, match=match):
            decode(broken)


def test_formats_bytes_and_vectors():
    """Matrices are quantised, vectors (norm gains) go as float16, integer tensors as they are; the bytes are what
    the arrays carry and what encoded_bytes prices."""
    state = {"w": torch.randn(128, 96), "norm": torch.ones(96), "ids": torch.arange(5)}
    for fmt in WIRE_FORMATS:
        sent = encode(state, fmt)
        assert torch.equal(sent["ids"], state["ids"])
        values = {k: v for k, v in sent.items() if k.startswith("w")}
        assert sum(v.nbytes for v in values.values()) - (8 if fmt in ("int8", "int4") else 0) == \
            encoded_bytes(fmt, 128 * 96)
        assert sent["norm"].dtype == (torch.float32 if fmt == "float32" else torch.float16)
    # per block of 64 values: 64 (int8) or 32 (int4) bytes of codes and a 2-byte float16 scale, against 256 bytes of
    # float32: 0.2578 and 0.1328 exactly (integer byte counts, no rounding to allow for)
    assert encoded_bytes("int8", 6400) * 256 == 66 * (4 * 6400)
    assert encoded_bytes("int4", 6400) * 256 == 34 * (4 * 6400)


def test_recipe_choices_are_the_quantisers_formats():
    assert CHOICES["fusion.wire_dtype"] is codec.WIRE_FORMATS and CHOICES["fusion.wire_up"] is codec.UPLINK


@pytest.mark.parametrize("overrides, match", [
    (["fusion.wire_up=int4", "privacy.mode=clip"], "fusion.wire_up: int4 cannot go with privacy.mode=clip"),
    (["fusion.wire_dtype=int8", "privacy.mode=local"], "fusion.wire_dtype: int8 cannot go with privacy.mode=local"),
    (["fusion.wire_up=float16"], "fusion.wire_up: 'float16' is not one of float32, int8, int4"),
    (["fusion.wire_dtype=int2"], "fusion.wire_dtype: 'int2' is not one of"),
])
def test_bad_wire_settings_are_refused_naming_the_key(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe("quickstart", overrides)


def test_wire_settings_load_and_need_a_method_that_sends_the_model():
    recipe = load_recipe("quickstart", ["fusion.wire_dtype=int4", "fusion.wire_up=int8", "fusion.error_feedback=false"])
    assert (recipe.fusion.wire_dtype, recipe.fusion.wire_up, recipe.fusion.error_feedback) == ("int4", "int8", False)
    assert load_recipe("quickstart", ["fusion.wire_dtype=float16", "privacy.mode=clip"]).fusion.wire_dtype == "float16"
    with pytest.raises(RecipeError, match="fusion.wire_up: int8 applies to the tiers of fusion.method=submodel or lora"):
        load_recipe("distill", ["fusion.wire_up=int8"])


# -- downlink: the reply's change is folded onto the exact target ------------------------------------------------
def _method(wire: Wire, policy: str = "rolling", stride: float = 0.25, hidden: int = 32,
            inter: int = 48) -> tuple[SubModelMethod, dict]:
    cfg = tiny_config(heads=4, kv_heads=4, hidden=hidden, inter=inter)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    return SubModelMethod(cfg, {"phone": 0.5}, state, policy=policy, stride=stride, wire=wire), state


@pytest.mark.parametrize("down, up", [("float16", "float32"), ("int4", "float32"), ("int8", "int8"), ("int4", "int8")])
def test_a_lossy_downlink_loses_no_part_of_an_update(down, up):
    """A client that trains nothing leaves the float32 target exactly as it was, whatever the rounding on the way
    down; one that moves every weight by 1e-3 moves the target as a float32 wire does (an int4 round trip of the
    weights alone would have moved them by up to ~10 %)."""
    folded = {}
    for wire, step in ((Wire(down, up), 0.0), (Wire(down, up), 1e-3), (Wire(), 1e-3)):
        method, state = _method(wire)
        clients = [Client(p, "phone", seed=p) for p in range(2)]
        updates = []
        for payload in method.payloads(1, state, clients):
            got = decode(payload.arrays)  # what the client trains from
            trained = {k: v + step for k, v in got.items()}
            reply, _ = client_reply(trained, payload.arrays, wire.up, None)
            updates.append(method.check(payload, reply, 1.0))
        new = method.fold(1, state, updates).target
        if step == 0:  # a zero change is exact all the way: x + 0, codes 0, a mean of zeros
            assert all(torch.equal(new[k], v) for k, v in state.items())
        else:
            folded[wire.lossless] = new
    # Each fold is within a few float32 roundings of v + 1e-3 per coordinate: the client's v' + 1e-3 and its change
    # (v' the value received, within half a downlink step of v: |v'| <= |v| + absmax / 7 generously), the mean over
    # the clients, the addition to the target; gamma_8 of those magnitudes covers both folds. int8 up adds half an
    # int8 step of the change (absmax 1e-3 and its roundings, / 127, in float16) and the decode's roundings.
    u, c = unit_roundoff(torch.float32), 1e-3
    for k, v in folded[True].items():
        top = float(state[k].abs().max())
        bound = gamma(8, torch.float32) * (state[k].abs() + top / 7 + c)
        if up == "int8":
            change = c + 2 * u * (top * (1 + 1 / 7) + c)
            bound = bound + change / (2 * 127) * (1 + unit_roundoff(torch.float16) + u) + 2 * u * change
        assert_within(folded[False][k], v, bound)


# -- uplink: error feedback --------------------------------------------------------------------------------------
def _uploads(deltas: list[torch.Tensor], up: str, feedback: bool) -> torch.Tensor:
    """The sum of what the server decodes of each round's upload of ``deltas`` from the same start."""
    received = {"w": torch.zeros_like(deltas[0])}
    arrays, residual, total = encode(received, "float32"), ({} if feedback else None), torch.zeros_like(deltas[0])
    for d in deltas:
        sent, left = client_reply({"w": d}, arrays, up, residual)
        residual = left if feedback else None
        total += decode(sent)["w"]
    return total


@pytest.mark.parametrize("up", ["int8", "int4"])
def test_error_feedback_keeps_the_sum_of_uploads_within_a_step_of_the_sum_of_changes(up):
    """Each round a block holds one large change and many small ones below half a quantisation step: without error
    feedback the small ones are rounded to zero every round and their error grows with the rounds; with it the
    uploads' sum stays within one step of the true sum."""
    torch.manual_seed(0)
    rounds = 200
    deltas = []
    for _ in range(rounds):
        d = torch.rand(8, BLOCK) * 0.002 + 0.001  # 0.001..0.003, below half a step of 1.0 / qmax for int4 and int8
        d[:, 0] = 1.0
        deltas.append(d)
    truth = torch.stack(deltas).sum(0)
    step = 1.0 / {"int8": 127, "int4": 7}[up]
    with_ef = (_uploads(deltas, up, True) - truth).abs().max()
    without = (_uploads(deltas, up, False) - truth).abs().max()
    assert with_ef <= step * 1.01
    assert without > 0.9 * rounds * 0.001  # every small change was lost: the error grew with the rounds
    assert without > 2 * step  # and past twice the bound error feedback keeps


def test_the_residual_follows_the_target_coordinates_of_a_moving_slice():
    """A residual kept for target rows 2..5 lands on the rows of the next slice that hold rows 4..5 again (its first
    two); the rows no longer held are dropped, new rows start at zero; a whole dim stays whole."""
    old = {"w": (7, (torch.tensor([2, 3, 4, 5]), None))}
    new = {"w": (7, (torch.tensor([4, 5, 6, 7]), None))}
    packed = unpack_index(pack_index(new), ["w"])
    assert packed["w"][0] == 7 and torch.equal(packed["w"][1][0], new["w"][1][0]) and packed["w"][1][1] is None
    residual = torch.arange(12.0).view(4, 3)
    moved = carry(store({"w": residual}, old), {"w": (4, 3)}, packed)["w"]
    assert torch.equal(moved, torch.cat([residual[2:], torch.zeros(2, 3)]))  # rows moved: copies
    wrapped = {"w": (7, (torch.tensor([0, 1, 6, 7]), None))}  # a rolling window wrapped around the axis
    assert len(pack_index(wrapped)) == 2 + 1 + 4 + 1
    with pytest.raises(ValueError, match="too short"):
        unpack_index(pack_index(new), ["v", "w"])


BIG = 0.05  # one value per block of every change: int4's step there is BIG / 7 = 0.0071


def _changes(shapes: dict[str, torch.Size], small: float = 2e-3) -> dict[str, torch.Tensor]:
    """A change per tensor: ``small`` to 1.5 x ``small`` everywhere but one value of :data:`BIG` per block of 64 of
    every matrix, so int4's half step in each block is above the small values: rounded alone they vanish."""
    out = {}
    for k, shape in shapes.items():
        v = small * (1 + 0.5 * torch.rand(shape))
        if len(shape) >= 2:
            v.view(-1)[::BLOCK] = BIG
        out[k] = v
    return out


def test_a_rolling_clients_uploads_track_its_changes_across_rounds():
    """Through SubModelMethod's payloads: a client whose window rolls by 1/8 a round (each unit held 4 rounds in a
    row, then left for 4) uploads int4 changes with error feedback kept in target coordinates; the server's decoded
    changes, summed in target coordinates, stay far closer to the client's true changes than without feedback
    (which loses every small change: 8 held rounds x 2e-3 and more), the residual a unit has when its window
    leaves it (under half a step) is what error feedback loses."""
    from fedfusion.models.slicing import scatter, stage_update

    errors = {}
    for feedback in (True, False):
        method, state = _method(Wire("float32", "int4", feedback), stride=0.125)
        torch.manual_seed(1)
        watched = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight")  # neurons, heads
        truth = {k: torch.zeros_like(state[k]) for k in watched}
        got = {k: torch.zeros_like(state[k]) for k in watched}
        residual: dict | None = {} if feedback else None
        for rnd in range(1, 17):
            (payload,) = method.payloads(rnd, state, [Client(0, "phone", seed=rnd)])
            plan = payload.context[0]
            received = decode(payload.arrays)
            change = _changes({k: v.shape for k, v in received.items()})
            reply, left = client_reply({k: received[k] + change[k] for k in received}, payload.arrays, "int4", residual)
            residual = left if feedback else None
            trained = method.check(payload, reply, 1.0).data
            exact = extract(state, method.config, plan)
            uploaded = {k: trained[k] - exact[k] for k in exact}
            for sums, sub in ((got, uploaded), (truth, change)):
                for name, index, value in stage_update(state, method.config, sub, plan):
                    if name in sums:
                        scatter(sums[name], index, value, accumulate=True)
        errors[feedback] = max(float((got[k] - truth[k]).abs().max()) for k in got)
    assert errors[False] > 8 * 2e-3
    assert errors[True] < 0.5 * errors[False]


# -- through the ClientApp's train handler -----------------------------------------------------------------------
class PatternRole:
    """A client role that adds :func:`_changes` to what it receives (the handler's wire path is under test)."""

    Node = Stateless

    def train(self, state, spec, partition, accelerator, node):
        change = _changes({k: v.shape for k, v in state.items()}, small=2e-3)
        return {k: v + change[k] for k, v in state.items()}, {"num-examples": 4, "train_loss": 1.0, "train_s": 0.1}


@pytest.mark.parametrize("feedback", [True, False])
def test_the_client_apps_train_handler_keeps_its_residual_in_context_state(monkeypatch, feedback):
    """The real ClientApp handler decodes an int4 payload, replies with the int4 change and, with error feedback,
    keeps the residual in the node's context.state between messages: over 10 rounds the server's decoded changes
    sum to the client's true ones within one quantisation step (BIG / 7); without it the small changes, 10 x 2e-3,
    are lost."""
    import fedfusion.client_app as client_app

    monkeypatch.setattr(client_app, "_role", lambda spec: PatternRole())
    method, state = _method(Wire("int4", "int4", feedback), policy="static")
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    key = "model.layers.0.self_attn.q_proj.weight"
    total, truth = 0.0, 0.0
    for rnd in range(1, 11):
        (payload,) = method.payloads(rnd, state, [Client(0, "phone", seed=rnd)])
        msg = Message(RecordDict({"arrays": ArrayRecord(payload.arrays), "config": ConfigRecord(payload.spec)}),
                      dst_node_id=1, message_type="train")
        torch.manual_seed(rnd)
        truth = truth + _changes({key: decode(payload.arrays)[key].shape})[key]
        torch.manual_seed(rnd)  # the role draws the same change
        reply = client_app.train(msg, ctx)
        arrays = reply.content["arrays"].to_torch_state_dict()
        assert {t.dtype for k, t in arrays.items() if k.endswith("::q")} == {torch.uint8}
        assert ("wire-residual" in ctx.state) == feedback
        exact = extract(state, method.config, payload.context[0])
        total = total + method.check(payload, arrays, 1.0).data[key] - exact[key]
    error = float((total - truth).abs().max())
    if feedback:
        assert error <= BIG / 7 * 1.01
    else:
        assert error > 10 * 2e-3 * 0.9


# -- LoRA and the ledger ------------------------------------------------------------------------------------------
def test_a_lora_reply_is_its_quantised_change_added_to_the_exact_adapter_sent():
    from fedfusion.fusion.lora.method import LoRAMethod
    from fedfusion.fusion.lora.spec import LoRABaseSpec
    from fedfusion.wire.specs import WireSpec

    modules = {"layers.0.q": (16, 12), "layers.0.v": (16, 12)}
    wire = Wire("int8", "int4")
    method = LoRAMethod(modules, {"phone": 4}, {"phone": 8.0}, {}, "fedavg", base_params=1000,
                        base=LoRABaseSpec("base", "float32", ("q", "v"), 0.0), wire=wire)
    (payload,) = method.payloads(1, {}, [Client(0, "phone", seed=3)])
    assert WireSpec.read(payload.spec) == WireSpec("int4", True) and any(k.endswith("::q") for k in payload.arrays)
    received = decode(payload.arrays)
    torch.manual_seed(0)
    change = {k: 1e-2 * torch.randn_like(v) for k, v in received.items()}
    reply, _ = client_reply({k: received[k] + change[k] for k in received}, payload.arrays, "int4", {})
    data = method.check(payload, reply, 1.0).data
    for m in modules:
        for x, got in (("A", data.A[m]), ("B", data.B[m])):
            key = f"{m}.lora_{x}"
            step = float(change[key].abs().max()) / 7
            assert float((got - (payload.context[key] + change[key])).abs().max()) <= step / 2 * 1.01
    cost = method.tier_cost("phone")
    adapter = method.adapter_params("phone")
    assert cost.nbytes == sum(encoded_bytes("int8", n) for o, i in modules.values() for n in (4 * i, o * 4))
    assert cost.bytes_up < cost.nbytes < 4 * adapter * 0.3


def test_the_ledger_counts_the_bytes_the_messages_carried():
    """FusionStrategy's clients.jsonl rows: bytes_down / bytes_up are what the quantised messages carry (codes,
    scales, shapes, index, and Flower's ~130 bytes of npy header and key per array); on a slice of 64 x 256 layers
    an int4 wire moves under a quarter of the float32 bytes each way (on the 32 x 48 test model the headers of
    three arrays per tensor would weigh a third)."""

    from fedfusion.devices.catalog import load_catalog
    from fedfusion.selection.participation import Participation
    from fedfusion.selection.selectors import make_selector
    from tests.test_strategy import FakeGrid, new_strategy

    grid = FakeGrid({11: "phone", 12: "phone"})
    moved = {}
    for wire in (Wire(), Wire("int4", "int4")):
        method, state = _method(wire, hidden=64, inter=256)
        strategy = new_strategy({"phone": method}, clients_per_round=2, query_config={"population": "{}"},
                                  participation=Participation(make_selector("random", seed=0), load_catalog()),
                                  train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0)
        msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
        replies = []
        for m in msgs:
            arrays = m.content["arrays"].to_torch_state_dict()
            got = decode(arrays)
            reply, _ = client_reply({k: v + 1e-3 for k, v in got.items()}, arrays, wire.up, {})
            replies.append(Message(RecordDict({"arrays": ArrayRecord(reply), "metrics": MetricRecord(
                {"num-examples": 4, "train_loss": 1.0, "train_s": 0.1})}), reply_to=m))
            assert strategy.run.round.rows[m.metadata.dst_node_id].bytes_down == m.content["arrays"].count_bytes()
        sizes = [r.content["arrays"].count_bytes() for r in replies]  # aggregate_train lets a reply's arrays go
        strategy.aggregate_train(1, replies)
        rows = list(strategy.run.round.rows.values())
        assert {r.status for r in rows} == {"ok"}
        assert [r.bytes_up for r in rows] == sizes
        moved[wire.down] = (sum(r.bytes_down for r in rows), sum(r.bytes_up for r in rows))
    assert moved["int4"][0] < 0.25 * moved["float32"][0] and moved["int4"][1] < 0.25 * moved["float32"][1]
