"""A frozen target held as it travelled (fedfusion.models.frozen): the int8/int4 matrices stay narrow on the device,
and the window trains exactly as on the decoded float32 target."""

from __future__ import annotations

import pytest
import torch

from fedfusion.fusion.base import Client
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import model_from_state
from fedfusion.models.families import family_of
from fedfusion.models.frozen import FrozenLinear
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


@pytest.mark.parametrize("frozen,rank", [("int8", 0), ("int4", 0), ("float16", 0), ("int8", 2)])
def test_a_packed_target_trains_the_window_as_the_decoded_one_does(frozen, rank):
    """The device keeps the frozen matrices as they travelled; its losses and trained window equal those of the
    same payload decoded to float32 (the values it stands for)."""
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
    with torch.no_grad():
        assert torch.allclose(lm_loss(packed, data)[0], lm_loss(dense, data)[0], atol=1e-6)
    a = train_steps(packed, data, steps=3, lr=1e-2, batch_size=8, seed=1)
    b = train_steps(dense, data, steps=3, lr=1e-2, batch_size=8, seed=1)
    assert a.loss == pytest.approx(b.loss, abs=1e-5)
    got, want = packed.trained(), dense.trained()
    assert set(got) == set(want)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-5
    assert max(float((got[k] - v).abs().max()) for k, v in decode(payload.arrays).items()
               if k in got and not k.startswith(FROZEN)) > 1e-3  # the window did train


def test_decode_keeps_the_frozen_entries_as_they_travelled():
    arrays = encode({"frozen/w": torch.randn(8, 64), "w": torch.randn(8, 64)}, "int8")
    kept = decode(arrays, keep=FROZEN)
    assert set(kept) == {"w", "frozen/w" + CODES, "frozen/w::scale", "frozen/w::shape"}
    assert kept["frozen/w" + CODES].dtype == torch.int8 and kept["w"].dtype == torch.float32


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_a_window_on_a_packed_target_computes_the_target_in_every_family(family):
    """Linear layers (with biases: OPT) become FrozenLinear; GPT-2's Conv1D stays dense; either way the logits are
    the target's."""
    cfg = CONFIGS[family]()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.25, scale=False)
    model = WindowModel(cfg, state, extract(state, cfg, plan), plan).eval()  # GPT-2 and OPT have dropout
    with torch.no_grad():
        want = model_from_state(cfg, state).eval()(**inputs(family)).logits
        got = model(**inputs(family)).logits
    assert torch.allclose(want, got, atol=1e-6)


def test_moving_the_model_moves_its_frozen_target():
    cfg, payload, _ = _payload("int8")
    model = from_payload(cfg, decode(payload.arrays, keep=FROZEN), WindowSpec.from_config(payload.spec), 7)
    model.to("meta")
    assert {t.device.type for t in model.target().state_dict().values()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


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
    shared window too, written through parametrizations that the recompute sees), fewer bytes kept."""
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
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
    fresh = build().train()
    before = _saved_bytes(fresh, data[:8])
    checkpoint_activations(fresh)
    assert _saved_bytes(fresh, data[:8]) < 0.6 * before
