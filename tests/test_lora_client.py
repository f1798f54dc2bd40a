"""The LoRA client role on a tiny frozen base: adapter in/out, frozen merged updates, training, 4-bit."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch
from flwr.app import ConfigRecord
from fp_bounds import assert_within, gamma
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.data.text import build_char_tokenizer
from fedfusion.fusion.lora.aggregate import effective_delta
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
from fedfusion.train.instruct import evaluate_instruct
from fedfusion.wire.specs import ClientSpec, FaultSpec, RoundSpec, TrainSpec, merge
from tests.conftest import LazyModule

# the LoRA role imports peft and bitsandbytes (seconds): on first use, not at collection, and on one xdist worker only
client = LazyModule("fedfusion.clients.lora")
adapters = LazyModule("fedfusion.models.adapters")
pytestmark = pytest.mark.xdist_group("peft")

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MODULES = ("q_proj", "v_proj")
DATA = json.dumps({"source": "chatterbot", "num_clients": 21, "split": "category", "held_out": 0.1, "seed": 0})


def recording(modules: dict[str, torch.nn.Module]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list]:
    """Forward hooks recording each module's last (input, output), registered now: after any hook already there,
    so the output is the one the model goes on with. Returns (records, handles)."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda _, args, y, name=name: seen.__setitem__(name, (args[0].detach(), y.detach())))
               for name, m in modules.items()]
    return seen, handles


def assert_layer_adds(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """A float32 layer's output ``y`` on its input ``x`` is ``x (W + B A)^T`` however it is associated (``W`` edited,
    ``B A`` formed, or ``(x A^T) B^T`` added): within ``gamma_{k+r+1} (|x| |W|^T + |x| |A|^T |B|^T)`` (fp_bounds)."""
    x, w, a, b = (t.detach().reshape(-1, t.shape[-1]).double() for t in (x, w, a, b))
    bound = gamma(x.shape[1] + a.shape[0] + 1, torch.float32) * (x.abs() @ w.abs().T + x.abs() @ a.abs().T @ b.abs().T)
    assert_within(y.reshape(len(x), -1), x @ (w + b @ a).T, bound)


def save_tiny_base(path) -> str:
    """A seeded 2-layer Llama with the character tokenizer and a chat template, saved as a local base."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )).save_pretrained(path)
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def spec(base: str, **kw) -> ConfigRecord:
    values = merge(ClientSpec(DATA, 96, 1), TrainSpec(8, 1e-2, 4, 0.0, "adamw"), RoundSpec(1, 3),
                   LoRABaseSpec(base, "float32", tuple(MODULES), 0.0), QuantizeSpec(0), AdapterSpec("flexlora", 4, 8.0))
    return ConfigRecord({**values, **kw})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny base; quantised copies go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDFUSION_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield save_tiny_base(tmp_path_factory.mktemp("base") / "tiny")


def factors(arrays: dict[str, torch.Tensor], kind: str = "lora") -> tuple[dict, dict]:
    A = {k.removesuffix(f".{kind}_A"): v for k, v in arrays.items() if k.endswith(f".{kind}_A")}
    B = {k.removesuffix(f".{kind}_B"): v for k, v in arrays.items() if k.endswith(f".{kind}_B")}
    return A, B


def test_training_replies_only_adapter_tensors_that_lower_the_clients_loss(base):
    arrays, metrics = client.train({}, spec(base), partition=0)
    A, B = factors(arrays)
    assert len(arrays) == 2 * len(A) == 2 * 2 * 2  # A and B of q_proj and v_proj in both layers
    assert all(a.shape == (4, 64) and a.dtype == torch.float32 for a in A.values())
    assert B["model.layers.0.self_attn.v_proj"].shape == (32, 4)  # GQA: 2 kv heads of 16
    assert metrics["num-examples"] == client.num_examples(spec(base), 0) > 50 and metrics["train_s"] > 0
    # the trained adapter, applied as a frozen update (alpha / r folded in), lowers the training loss
    data = client.client_data(DATA, 0, base, 96, "train")
    plain = client.frozen_base(base, 0, "float32")
    before = evaluate_instruct(plain, data)["eval_loss"]
    merged = {}
    for m in A:
        merged[f"{m}.merged_A"], merged[f"{m}.merged_B"] = A[m], B[m] * (8.0 / 4)
    with adapters.merged_update(plain, merged) as hooked:
        assert hooked == 4
        after = evaluate_instruct(plain, data)["eval_loss"]
    assert after < before - 0.05
    assert not adapters.lora_layers(plain)  # the cached base lost its adapter layers again
    assert evaluate_instruct(plain, data)["eval_loss"] == before  # and its hooks: the same operations, bit for bit


def test_received_factors_load_into_the_first_components_and_round_trip(base):
    model = adapters.attach_adapter(client.frozen_base(base, 0, "float32"), 6, 12.0, list(MODULES), 0.0, seed=0)
    try:
        fresh = adapters.adapter_factors(model)
        g = torch.Generator().manual_seed(1)
        sent = {k: torch.randn(4 if k.endswith("_A") else v.shape[0], *(v.shape[1:] if k.endswith("_A") else (4,)),
                               generator=g) for k, v in fresh.items()}
        adapters.load_factors(model, sent)
        got = adapters.adapter_factors(model)
        for k, v in sent.items():
            if k.endswith("_A"):
                assert torch.equal(got[k][:4], v) and torch.equal(got[k][4:], fresh[k][4:])
            else:
                assert torch.equal(got[k][:, :4], v) and not got[k][:, 4:].any()  # fresh B components are zero
        # the effective update (alpha / r) B A is exactly what was sent, scaled for rank 6
        # (both 2 B A, in float64 rounded to float32: within two float32 roundings and the float64 sum's of each other)
        m = "model.layers.1.self_attn.q_proj"
        a, b = sent[f"{m}.lora_A"].double(), sent[f"{m}.lora_B"].double()
        assert_within(effective_delta(got[f"{m}.lora_A"], got[f"{m}.lora_B"], 12.0),
                      effective_delta(sent[f"{m}.lora_A"], sent[f"{m}.lora_B"], 12.0 * 4 / 6),
                      (2 * gamma(1, torch.float32) + gamma(6, torch.float64)) * 2 * b.abs() @ a.abs())
        # and the peft model computes base + (alpha / r) B A with them: the scaling the server assumes, layer by layer
        # (each adapted layer against the exact one on its own input; the logits, downstream of differently associated
        # products through the network, have no bound worth asserting)
        ids = torch.randint(100, (2, 10))
        names = factors(got)[0]
        seen, handles = recording({n: model.get_submodule(f"base_model.model.{n}") for n in names})
        model(input_ids=ids)
        for h in handles:
            h.remove()
        plain = model.unload()
        frozen = {}
        for name in names:
            frozen[f"{name}.merged_A"], frozen[f"{name}.merged_B"] = got[f"{name}.lora_A"], got[f"{name}.lora_B"] * 2.0
        with adapters.merged_update(plain, frozen):
            hooked, handles = recording({n: plain.get_submodule(n) for n in names})
            plain(input_ids=ids)
            for h in handles:
                h.remove()
        assert set(seen) == set(hooked) == set(names)
        for name in names:
            w, a, b = plain.get_submodule(name).weight, got[f"{name}.lora_A"], got[f"{name}.lora_B"] * 2.0
            for x, y in (seen[name], hooked[name]):
                assert_layer_adds(x, y, w, a, b)
        model = adapters.attach_adapter(plain, 6, 12.0, list(MODULES), 0.0, seed=0)
        with pytest.raises(ValueError, match="do not fit adapter"):
            adapters.load_factors(model, {k: torch.zeros(7, v.shape[1]) if k.endswith("_A") else torch.zeros(v.shape[0], 7)
                                        for k, v in fresh.items()})
        with pytest.raises(ValueError, match="does not match"):
            adapters.load_factors(model, {"model.layers.0.mlp.up_proj.lora_A": torch.zeros(1, 64)})
    finally:
        model.unload()


def test_a_merged_update_equals_adding_it_to_the_weights(base):
    """The hooked layer, the layer with ``B A`` added to its weight, and the hooked dense form each compute
    ``x (W + B A)^T`` on their input, to float32 rounding (``assert_layer_adds``); the logits downstream are not
    compared (differently associated products through the network: no bound worth asserting)."""
    plain = client.frozen_base(base, 0, "float32")
    m = "model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 64, generator=g), torch.randn(64, 3, generator=g)
    w = plain.get_submodule(m).weight.detach().clone()
    ids = torch.randint(100, (2, 10))
    with adapters.merged_update(plain, {f"{m}.merged_A": a, f"{m}.merged_B": b}):
        seen, handles = recording({m: plain.get_submodule(m)})
        plain(input_ids=ids)
        handles[0].remove()
    assert_layer_adds(*seen[m], w, a, b)
    edited = LlamaForCausalLM.from_pretrained(base)
    with torch.no_grad():
        edited.get_submodule(m).weight += b @ a
    seen, _ = recording({m: edited.get_submodule(m)})
    edited(input_ids=ids)
    assert_layer_adds(*seen[m], w, a, b)
    with adapters.merged_update(plain, {f"{m}.merged_W": b @ a}):  # the dense form FLoRA sends when smaller
        seen, handles = recording({m: plain.get_submodule(m)})
        plain(input_ids=ids)
        handles[0].remove()
    assert_layer_adds(*seen[m], w, a, b)
    with pytest.raises(ValueError, match="does not have"):
        with adapters.merged_update(plain, {"nope.merged_A": a, "nope.merged_B": b}):
            pass


def test_one_process_serves_different_ranks_and_faults_follow_the_spec(base):
    arrays, _ = client.train({}, spec(base, rank=2, alpha=2.0, **{"local-steps": 1}), partition=1)
    assert next(iter(factors(arrays)[0].values())).shape[0] == 2
    arrays, _ = client.train({}, spec(base, rank=8, **{"local-steps": 1, **FaultSpec(corrupt_prob=1.0).to_config()}),
                             partition=1)
    assert next(iter(factors(arrays)[0].values())).shape[0] == 8
    assert any(torch.isnan(v).any() for v in arrays.values())
    with pytest.raises(RuntimeError, match="injected crash"):
        client.train({}, spec(base, **FaultSpec(crash_prob=1.0).to_config()), partition=1)
    with pytest.raises(ValueError, match="outside the population"):
        client.train({}, spec(base), partition=21)


def _cpu_4bit_reason() -> str | None:
    """None when bitsandbytes can run a 4-bit matmul on this CPU, else why not."""
    if find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(8, 8, quant_type="nf4", compute_dtype=torch.float32)
        layer.load_state_dict(torch.nn.Linear(8, 8).state_dict())
        layer = layer.to("cpu")
        layer(torch.randn(2, 8))
    except Exception as exc:  # the reason is reported in the skip
        return f"bitsandbytes cannot run 4-bit on this CPU: {type(exc).__name__}: {exc}"
    return None


def test_a_4bit_base_trains_an_adapter(base):
    if (reason := _cpu_4bit_reason()) is not None:  # asked here, not in a skipif: that imports bitsandbytes at collection
        pytest.skip(reason)
    arrays, metrics = client.train({}, spec(base, quantize=4, **{"local-steps": 4}), partition=2)
    assert type(client.frozen_base(base, 4, "float32").model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    A, B = factors(arrays)
    assert all(torch.isfinite(t).all() for t in arrays.values()) and any(b.abs().sum() > 0 for b in B.values())
    assert metrics["train_loss"] > 0


@pytest.mark.slow  # a fresh Python process per case: seconds each
def test_a_client_process_loads_its_base_without_progress_bars(base):
    """Every simulated LoRA client used to print transformers' "Loading weights" bar for every base it loaded."""
    import subprocess
    import sys

    code = ("from fedfusion.clients import lora; "
            f"lora.frozen_base({base!r}, 0, 'float32'); print('loaded')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "loaded" in out.stdout
    assert "Loading weights" not in out.stderr and "it/s]" not in out.stderr, out.stderr[-500:]


def test_the_client_app_trains_a_quantised_adapter_and_replies_its_int4_change(base):
    """Through the real ClientApp handler and LoRA role: an int8 adapter down, its int4 change up with the residual in
    context.state; the method folds the reply onto the exact adapter it sent, and the adapter moved."""
    from flwr.app import ArrayRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    import fedfusion.client_app as client_app
    from fedfusion.fusion.base import Client
    from fedfusion.fusion.lora.method import LoRAMethod, adapted_modules
    from fedfusion.wire.quantize import Wire

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    modules = adapted_modules(client.frozen_base(base, 0, "float32"), list(MODULES))
    method = LoRAMethod(modules, {"phone": 4}, {"phone": 8.0}, {}, "fedavg", base_params=1000,
                        base=LoRABaseSpec(base, "float32", tuple(MODULES), 0.0), wire=Wire("int8", "int4"))
    (payload,) = method.payloads(1, {}, [Client(0, "phone", seed=3)])
    config = ConfigRecord({**dict(spec(base, **{"local-steps": 3})), **payload.spec})
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"arrays": ArrayRecord(payload.arrays), "config": config}), dst_node_id=1,
                  message_type="train")
    reply = client_app.train(msg, ctx).content["arrays"].to_torch_state_dict()
    assert all(v.dtype == torch.uint8 for k, v in reply.items() if k.endswith("::q")) and "wire-residual" in ctx.state
    update = method.check(payload, reply, 1.0)
    moved = max(float((update.data.B[m] - payload.context[f"{m}.lora_B"]).abs().max()) for m in modules)
    assert moved > 0  # B starts at 0: any trained change shows
