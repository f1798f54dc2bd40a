"""A frozen target held as it travelled (fedfusion.models.frozen): the int8/int4 matrices stay narrow on the device,
and the window trains exactly as on the decoded float32 target."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_within, gamma, matmul_bound

from fedfusion.fusion.base import Client
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import config_aliases, model_from_state, wire_state
from fedfusion.models.families import family_of
from fedfusion.models.frozen import FrozenLinear, as_packed, frozen_target
from fedfusion.models.full_forward import WindowModel, from_payload
from fedfusion.models.slicing import extract, plan_slice
from fedfusion.train.loop import checkpoint_activations, lm_loss, train_steps
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import CODES, decode, encode
from fedfusion.wire.specs import WindowSpec
from tests.conftest import tiny_config
from tests.test_slice_families import CONFIGS, inputs


def _payload(frozen: str, rank: int = 0):
    cfg = tiny_config()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    method = SubModelMethod(cfg, {"t": 0.25}, state, forward="full", frozen=frozen, window_rank=rank, scale=False,
                            policy="rolling")
    payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=7)])[0]
    return cfg, payload, torch.randint(0, cfg.vocab_size, (16, 17))


def _operands(model) -> dict[str, list]:
    """Per window-carrying or low-rank FrozenLinear of ``model``, [its input, its output's gradient], filled by one
    forward and backward."""
    seen: dict[str, list] = {}
    for name, m in model.target().named_modules():
        if isinstance(m, FrozenLinear) and (m._window is not None or m._low_rank is not None):
            seen[name] = [m]
            m.register_forward_pre_hook(lambda _, args, name=name: seen[name].append(args[0].detach()))
            m.register_full_backward_hook(lambda _, __, grad, name=name: seen[name].append(grad[0].detach()))
    return seen


@pytest.mark.parametrize("frozen,rank", [("int8", 0), ("int4", 0), ("float16", 0), ("int8", 2)])
def test_a_packed_target_trains_the_window_as_the_decoded_one_does(frozen, rank):
    """The device keeps the frozen matrices as they travelled; its loss and window gradients are those of the same
    payload decoded to float32 (the values it stands for).

    The packed layer makes its float32 matrix element by element (codes times scale: IEEE-exact, so the decoded
    model's values bit for bit) and multiplies as ``nn.Linear`` does, so the loss is the decoded model's bit for bit.
    Its window gradient is the product of the window's rows of ``g`` and columns of ``x`` over the N tokens, the
    decoded model's the same entries of the full ``g^T x``: each within ``gamma_N |g|^T |x|`` of the exact product
    (fp_bounds), so within twice that of each other; a rank-r update's ``B`` gradient is ``g^T (x A^T)`` against
    ``(g^T x) A^T``, each within ``gamma_{N+k} |g|^T |x| |A|^T``. Every other gradient runs the same operations.
    After a step, AdamW's ``g / (|g| + eps)`` turns rounding-level differences into no bound worth asserting, so
    the trained windows are not compared; that the window trains is checked on the packed model."""
    cfg, payload, data = _payload(frozen, rank)
    spec = WindowSpec.from_config(payload.spec)
    packed = from_payload(cfg, decode(payload.arrays, keep=FROZEN), spec, 7)
    dense = from_payload(cfg, decode(payload.arrays), spec, 7)
    layers = [m for m in packed.target().modules() if isinstance(m, FrozenLinear)]
    assert len(layers) == 7 * cfg.num_hidden_layers + 1  # every projection and the untied head
    if frozen != "float16":
        assert all(m.codes.dtype in (torch.int8, torch.uint8) for m in layers)
    float_bytes = 4 * sum(m.stored().value().numel() for m in layers)
    assert sum(m.stored().nbytes() for m in layers) <= {"int8": 0.27, "int4": 0.15, "float16": 0.5}[frozen] * float_bytes
    seen = _operands(packed)
    batch = data[:8]
    loss_p, loss_d = lm_loss(packed, batch)[0], lm_loss(dense, batch)[0]
    assert torch.equal(loss_p, loss_d)
    loss_p.backward()
    loss_d.backward()
    grads = {n: p.grad for n, p in dense.named_parameters()}
    names = {id(p): n for n, p in packed.named_parameters()}
    bounded = set()
    for m, x, g in seen.values():
        x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        if m._window is not None:
            slot, (rows, cols) = m._window
            values = slot()
            g_r = g if rows is None else g.index_select(1, rows)
            x_c = x if cols is None else x.index_select(1, cols)
            assert_within(values.grad, grads[names[id(values)]], 2 * matmul_bound(g_r.T, x_c))
            bounded.add(names[id(values)])
        if m._low_rank is not None:
            a, b = (slot() for slot in m._low_rank)
            bound = 2 * gamma(len(x) + x.shape[1], torch.float32) * (g.abs().T.double() @ x.abs().double()
                                                                    @ a.abs().T.double())
            assert_within(b.grad, grads[names[id(b)]], bound)
            bounded.add(names[id(b)])
    assert bounded  # the window's (or update's) gradients were compared
    for name, p in packed.named_parameters():
        if name not in bounded and p.grad is not None:
            assert torch.equal(p.grad, grads[name]), name
    before = packed.trained()
    train_steps(packed, data, steps=3, lr=1e-2, batch_size=8, seed=1)
    got = packed.trained()
    assert max(float((got[k] - v).abs().max()) for k, v in before.items()) > 1e-3  # the window did train


@pytest.mark.parametrize("frozen,kind", [("int8", {}), ("int4", {}), ("float16", {}), ("float32", {}),
                                         ("int8", {"window_rank": 2}), ("int8", {"window_core": True})])
def test_an_expanded_target_trains_the_window_bit_for_bit_as_the_narrow_one(frozen, kind):
    """A tier whose memory holds the float32 target gets ``WindowSpec.expand``: its device makes each matrix float32
    once (the same IEEE-exact codes times scale the narrow path makes in every pass) and writes the window into that
    copy in place, so the losses and trained values equal the narrow path's exactly; the received arrays are not
    written into."""
    cfg = tiny_config()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    data = torch.randint(0, cfg.vocab_size, (16, 17), generator=torch.Generator().manual_seed(1))
    trained = {}
    for expand in (frozenset(), frozenset({"t"})):
        method = SubModelMethod(cfg, {"t": 0.25}, state, forward="full", frozen=frozen, scale=False, policy="rolling",
                                window_shared=True, expand=expand, **kind)
        payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=7)])[0]
        spec = WindowSpec.from_config(WindowSpec.from_config(payload.spec).to_config())
        assert spec.expand == bool(expand)
        received = decode(payload.arrays, keep=FROZEN)
        sent = {k: v.clone() for k, v in received.items()}
        model = from_payload(cfg, received, spec, 7)
        layers = [m for m in model.target().modules() if isinstance(m, FrozenLinear)]
        assert {m.codes.dtype == torch.float32 and m.scale is None for m in layers} == {True} or not expand
        out = train_steps(model, data, steps=3, lr=1e-2, batch_size=8, seed=1)
        trained[bool(expand)] = (out.loss, model.trained())
        assert all(torch.equal(received[k], v) for k, v in sent.items())  # what arrived is never written into
    assert trained[True][0] == trained[False][0]
    assert trained[True][1].keys() == trained[False][1].keys()
    assert all(torch.equal(trained[True][1][k], v) for k, v in trained[False][1].items())


def test_decode_keeps_the_frozen_entries_as_they_travelled():
    arrays = encode({"frozen/w": torch.randn(8, 64), "w": torch.randn(8, 64)}, "int8")
    kept = decode(arrays, keep=FROZEN)
    assert set(kept) == {"w", "frozen/w" + CODES, "frozen/w::scale", "frozen/w::shape"}
    assert kept["frozen/w" + CODES].dtype == torch.int8 and kept["w"].dtype == torch.float32


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_a_window_on_a_packed_target_computes_the_target_in_every_family(family):
    """Linear layers (with biases: OPT) become FrozenLinear; GPT-2's Conv1D stays dense; either way the logits are
    the target's. Each FrozenLinear's output is within ``gamma_{k+1} (|x| |W^T| + |b|)`` of the exact ``x W^T + b`` of
    the target's own weights (fp_bounds); without biases the window model runs the target's operations on the same
    values and its logits are the target's bit for bit. (With biases it adds each after the product where
    ``nn.Linear`` may fuse it into the GEMM: a rounding apart per layer, and no bound on the logits worth asserting.)"""
    cfg = CONFIGS[family]()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.25, scale=False)
    model = WindowModel(cfg, state, extract(state, cfg, plan), plan).eval()  # GPT-2 and OPT have dropout
    seen = []
    for name, m in model.target().named_modules():
        if isinstance(m, FrozenLinear):
            m.register_forward_hook(lambda _, args, y, name=name: seen.append((name, args[0], y)))
    with torch.no_grad():
        want = model_from_state(cfg, state).eval()(**inputs(family)).logits
        got = model(**inputs(family)).logits
    assert seen or family == "gpt2"  # GPT-2: Conv1D layers and a tied head, nothing packed
    for name, x, y in seen:
        w, b = state[f"{name}.weight"], state.get(f"{name}.bias")
        x = x.reshape(-1, x.shape[-1])
        bias = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
        bound = gamma(x.shape[1] + 1, torch.float32) * (x.abs().double() @ w.abs().T.double() + bias.abs())
        assert_within(y.reshape(len(x), -1), x.double() @ w.T.double() + bias, bound)
    if all(state.get(f"{name}.bias") is None for name, _, _ in seen):
        assert torch.equal(want, got)


def test_moving_the_model_moves_its_frozen_target():
    cfg, payload, _ = _payload("int8")
    model = from_payload(cfg, decode(payload.arrays, keep=FROZEN), WindowSpec.from_config(payload.spec), 7)
    model.to("meta")
    assert {t.device.type for t in model.target().state_dict().values()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_building_a_frozen_target_allocates_no_float32_copy_of_its_matrices(family, monkeypatch):
    """A device holds the matrices as they travelled from the first byte: the model is built with its parameters on
    the meta device, so no linear layer's float32 matrix is allocated (or randomly initialised) on the way; tied
    embeddings stay one tensor."""
    cfg = CONFIGS[family]()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.25, scale=False)
    made: list[torch.device] = []
    reset = torch.nn.Linear.reset_parameters
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: (made.append(self.weight.device), reset(self)))
    model = WindowModel(cfg, state, extract(state, cfg, plan), plan)
    assert made and {d.type for d in made} == {"meta"}
    target = model.target()
    assert not [n for n, t in [*target.named_parameters(), *target.named_buffers()] if t.device.type == "meta"]
    bare = frozen_target(cfg, as_packed(wire_state(state, config_aliases(cfg))))
    if cfg.tie_word_embeddings:
        assert bare.get_output_embeddings().weight is bare.get_input_embeddings().weight


def _saved_bytes(model, data: torch.Tensor) -> int:
    """Bytes autograd keeps for backward over one forward pass (checkpointed layers keep theirs to themselves)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model, data)
    return total[0]


@pytest.mark.parametrize("kind", ["window", "core", "rank", "slice"])
def test_activation_checkpointing_trains_the_same_values_and_keeps_fewer_activations(kind):
    """train.checkpoint recomputes each layer in backward: the same trained values (norms and embeddings of a
    shared window too, written through parametrizations that the recompute sees), fewer bytes kept. The recompute
    repeats the forward's operations in the same order on the same thread, so the values are equal bit for bit (a
    tolerance would be no help: after AdamW's first step a rounding-level difference is no longer small)."""
    cfg = tiny_config()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    data = torch.randint(0, cfg.vocab_size, (16, 33))

    def build():
        if kind == "slice":
            return model_from_state(cfg, state)
        method = SubModelMethod(cfg, {"small": 0.25, "t": 0.25}, state, forward="full", frozen="int8", scale=False,
                                policy="rolling", window_shared=kind != "window", window_core=kind == "core",
                                window_rank=2 if kind == "rank" else 0)
        payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=7)])[0]
        return from_payload(cfg, decode(payload.arrays, keep=FROZEN), WindowSpec.from_config(payload.spec), 7)

    plain, checkpointed = build(), build()
    train_steps(plain, data, steps=3, lr=1e-2, batch_size=8, seed=1)
    train_steps(checkpointed, data, steps=3, lr=1e-2, batch_size=8, seed=1, checkpoint=True)
    got = checkpointed.trained() if kind != "slice" else checkpointed.state_dict()
    want = plain.trained() if kind != "slice" else plain.state_dict()
    # recomputing a layer in backward runs the same operations in the same order: the same values bit for bit
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh = build().train()
    before = _saved_bytes(fresh, data[:8])
    checkpoint_activations(fresh)
    assert _saved_bytes(fresh, data[:8]) < 0.6 * before
