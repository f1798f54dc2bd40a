"""Phones fine-tuning LoRA adapters: the frozen-base ExecuTorch training program (the adapter's factors trained, the
base a separate data file checked by hash) trains through the runtime as the LoRA client trains with torch, on a
tiny local Llama base (no network), with a float32 base and with 8-bit and 4-bit frozen bases."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from model_bounds import ExactLM, assert_replayed, assert_steps, batches, optimizer_steps, runtime_steps

from tests.conftest import LazyModule

adapters = LazyModule("fedfusion.models.adapters")  # peft imports bitsandbytes: on first use, not at collection
pytestmark = [pytest.mark.device, pytest.mark.slow, pytest.mark.xdist_group("peft"),
              pytest.mark.usefixtures("one_thread")]

MODULES = ["q_proj", "v_proj"]
RANK, ALPHA, BATCH, SEQ = 4, 8.0, 4, 48


def tiny_base():
    """A seeded 2-layer Llama (grouped-query attention) of the LoRA client tests' shape, eval mode, frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256))
    return base.requires_grad_(False).eval()


def instruct_data():
    """Instruction pairs of different lengths, encoded with the character tokenizer (right-padded, -100 prompts)."""
    from fedfusion.data.pairs import Pair
    from fedfusion.data.text import build_char_tokenizer
    from fedfusion.train.instruct import encode_pairs

    pairs = [Pair(f"what is {i} plus {i}?", f"it is {2 * i}" + "!" * (i % 5)) for i in range(24)]
    return encode_pairs(build_char_tokenizer(), pairs, SEQ)


def start_adapter(base, rank: int):
    """A client's whole starting adapter as LoRAMethod sends it: 2 served components (B nonzero) and fresh ones."""
    from fedfusion.fusion.lora.aggregate import starting_adapter
    from fedfusion.fusion.lora.method import adapted_modules

    shapes = adapted_modules(base, MODULES)
    gen = torch.Generator().manual_seed(5)
    served = ({m: torch.randn(2, i, generator=gen) * 0.1 for m, (o, i) in shapes.items()},
              {m: torch.randn(o, 2, generator=gen) * 0.1 for m, (o, i) in shapes.items()})
    A, B = starting_adapter(shapes, rank, served, seed=7)
    return {**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": b for m, b in B.items()}}


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def data():
    return instruct_data()


@pytest.fixture(scope="module")
def programs(base):
    """The rank-4 adapter's program on the float32 base, exported once per module."""
    from fedfusion.phone.program import export_lora_program

    return {0: export_lora_program(base, MODULES, RANK, ALPHA, BATCH, SEQ)}


def factors(model) -> dict:
    """The adapter's factor parameters of a peft model, by wire name (``m.lora_A``, ``m.lora_B``)."""
    return {f"{name}.{which}": adapters.factor(layer, which)
            for name, layer in adapters.lora_layers(model).items() for which in ("lora_A", "lora_B")}


def torch_steps(base, start, data, steps: int, lr: float, optimizer: str, bits: int = 0):
    """The LoRA client's training in torch: peft adapter on (a copy of) the base, train_steps with the response
    loss; ``bits``: the same integer frozen base the device program holds. Each step's factors and gradient as the
    optimizer saw them, and the loop's result."""
    from fedfusion.phone.program import quantize_frozen
    from fedfusion.train.instruct import RESPONSE
    from fedfusion.train.loop import train_steps

    model = adapters.attach_adapter(copy.deepcopy(base), RANK, ALPHA, MODULES, 0.0, 0)
    adapters.load_factors(model, start)
    if bits:
        assert quantize_frozen(model, bits) == 2 * 7 + 1  # every frozen Linear: 7 per layer and the head
    with optimizer_steps(factors(model)) as seen:
        result = train_steps(model, data, steps, lr, BATCH, seed=11, optimizer=optimizer, loss=RESPONSE)
    return seen, result


def exact_adapter(base, start, bits: int = 0) -> ExactLM:
    """The float64 reference: the adapter on a copy of the base whose frozen Linear layers hold what the device's
    do (with ``bits``, the integer base's dequantised values)."""
    from fedfusion.phone.program import quantize_frozen

    model = adapters.attach_adapter(copy.deepcopy(base), RANK, ALPHA, MODULES, 0.0, 0)
    adapters.load_factors(model, start)
    if bits:
        held = copy.deepcopy(model)
        quantize_frozen(held, bits)
        linears = dict(model.named_modules())
        with torch.no_grad():
            for name, module in held.named_modules():
                if hasattr(module, "dequantized"):
                    linears[name].weight.copy_(module.dequantized())
    params = {id(p): n for n, p in model.named_parameters()}
    return ExactLM(None, {}, model=model, trained={k: params[id(p)] for k, p in factors(model).items()})


def assert_parity(program, base, data, optimizer: str = "adamw", bits: int = 0, steps: int = 8) -> None:
    """N runtime steps are N torch steps: at every step the loss and gradient each computed at the factors it held
    are within float32's bounds of the exact ones on the step's rows (:mod:`model_bounds`), the runtime stepped by
    its gradients, both counted the same tokens, and the loss falls."""
    from fedfusion.phone.runtime import ProgramRunner, train_program

    lr = 1e-2 if optimizer == "adamw" else 0.5
    start = start_adapter(base, RANK)
    runner = ProgramRunner(program)
    runner.load(start)
    with runtime_steps(runner) as mine:
        stats = train_program(runner, data, steps, lr, BATCH, seed=11, optimizer=optimizer)
    theirs, result = torch_steps(base, start, data, steps, lr, optimizer, bits)
    assert stats.tokens == result.tokens
    exact, drawn = exact_adapter(base, start, bits), batches(data, steps, BATCH, 11)
    assert_steps(exact, mine, stats.losses, drawn)
    assert_steps(exact, theirs, result.losses, drawn)
    assert_replayed(start, mine, runner.params, optimizer, lr)
    assert sum(result.losses[-3:]) / 3 < result.losses[0]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_lora_program_trains_as_torch(programs, base, data, optimizer):
    assert_parity(programs[0], base, data, optimizer)


def test_lora_program_trains_the_adapter_only(programs, base):
    """The trained parameters are the adapter's factors by wire name; the frozen base is the data file (all of it,
    none in the program), the same bytes for an adapter of another rank; a changed base file is refused."""
    from fedfusion.phone.program import DeviceProgram, export_lora_program
    from fedfusion.phone.runtime import ProgramRunner

    program = programs[0]
    m = program.manifest
    start = start_adapter(base, RANK)
    assert {p["name"]: p["shape"] for p in m["parameters"]} == {k: list(v.shape) for k, v in start.items()}
    assert m["inputs"][0] == {"name": "input_ids", "shape": [BATCH, SEQ], "dtype": "int64"}
    frozen = sum(4 * p.numel() for p in base.parameters())
    assert m["data"]["holds"] == "frozen base" and frozen <= m["data"]["bytes"] == len(program.ptd)
    assert len(program.pte) < frozen / 2  # the base is not baked into the program
    other = export_lora_program(base, MODULES, 2, ALPHA, BATCH, SEQ)
    assert other.manifest["data"]["sha256"] == m["data"]["sha256"] and other.program_id != program.program_id
    bad = bytearray(program.ptd)
    bad[-1] ^= 1
    with pytest.raises(ValueError, match="sha256"):
        ProgramRunner(DeviceProgram(program.pte, bytes(bad), m))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_base_program_trains_as_torch(base, data, bits):
    """An 8-/4-bit frozen base (integer codes + float32 group scales, dequantised by core ops) runs in the portable
    runtime and trains as torch does on the same integer base; its data file is smaller than the float32 base's."""
    from fedfusion.phone.program import export_lora_program

    program = export_lora_program(base, MODULES, RANK, ALPHA, BATCH, SEQ, bits=bits)
    assert program.manifest["adapter"]["base_bits"] == bits
    assert program.manifest["data"]["bytes"] < 0.5 * sum(4 * p.numel() for p in base.parameters())
    assert_parity(program, base, data, bits=bits)


def test_export_device_command_writes_a_lora_program(tmp_path, capsys):
    """``fedfusion export-device`` with ``fusion.method=lora``: the phone tier's adapter (rank 4 on a 4-bit base, as
    the default recipe says) on a local base, its three files, and a runner that loads them."""
    from fedfusion.cli import main
    from fedfusion.phone.program import DeviceProgram
    from fedfusion.phone.runtime import ProgramRunner

    base_dir = tmp_path / "base"
    tiny_base().save_pretrained(base_dir)
    out = tmp_path / "programs"
    args = ["export-device", "rolling", "fusion.method=lora", "data.source=chatterbot", f"lora.base={base_dir}",
            f"train.seq_len={SEQ}", f"train.batch_size={BATCH}", "--tier", "phone", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "phone (rounds 1..12): rank-4 LoRA adapter" in printed and "4-bit frozen llama base" in printed
    program_id = next(out.glob("*.json")).stem
    runner = ProgramRunner(DeviceProgram.load(out, program_id))
    assert sorted(runner.params) == sorted(start_adapter(tiny_base(), RANK))


def test_gateway_and_reference_device_train_a_lora_adapter_for_two_rounds(tmp_path):
    """A SuperNode's relay hands two rounds of a LoRA client's message to the gateway; the reference device trains
    each through the runtime on its own instruction pairs. The adapter changes, the reply has the sent keys and
    shapes, and the device fetches the program and its frozen base once."""
    import threading

    from fedfusion.clients.device import relay
    from flwr.app import ConfigRecord

    from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
    from fedfusion.phone.gateway import Gateway, GatewayServer, Tokens, write_tokens
    from fedfusion.phone.reference import ReferenceDevice
    from fedfusion.wire.specs import ClientSpec, RoleSpec, RoundSpec, TrainSpec, merge
    from tests.test_lora_client import DATA, save_tiny_base

    base_dir = save_tiny_base(tmp_path / "base")  # the same seeded weights as tiny_base(), with a tokenizer
    tokens = tmp_path / "tokens.json"
    secret = write_tokens(tokens, {"tok-a": "phone-a"})
    (tmp_path / "secret").write_text(secret)
    gateway = Gateway(Tokens(tokens), tmp_path / "programs")
    (tmp_path / "programs").mkdir()
    fetched: list[str] = []
    serve_file = gateway.program_file
    gateway.program_file = lambda program, name: fetched.append(name) or serve_file(program, name)
    server = GatewayServer(("127.0.0.1", 0), gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    node = {"gateway": server.url, "gateway-secret-file": str(tmp_path / "secret"), "gateway-deadline-s": 300.0}
    device = ReferenceDevice(server.url, "tok-a")
    worker = threading.Thread(target=device.serve, kwargs={"tasks": 2, "poll_s": 0.1, "echo": lambda s: None})
    worker.start()
    try:
        state = start_adapter(tiny_base(), RANK)
        for server_round in (1, 2):
            spec = ConfigRecord(merge(ClientSpec(DATA, SEQ, 1), TrainSpec(4, 1e-2, BATCH, 0.0, "adamw"),
                                      RoundSpec(server_round, 3), RoleSpec("lora"),
                                      LoRABaseSpec(base_dir, "float32", tuple(MODULES), 0.0), QuantizeSpec(8),
                                      AdapterSpec("flexlora", RANK, ALPHA)))
            new, metrics = relay(state, spec, 2, node)
            assert list(new) == list(state) and all(new[k].shape == state[k].shape for k in state)
            assert any(not torch.equal(new[k], state[k]) for k in state)
            assert metrics["num-examples"] > 0 and metrics["train_loss"] > 0
            state = new
    finally:
        worker.join(timeout=120)
        server.shutdown()
        server.server_close()
    assert sorted(fetched) == ["manifest.json", "program.pte", "weights.ptd"]  # once, for both rounds
    manifest = json.loads(next((tmp_path / "programs").glob("*.json")).read_text())
    assert manifest["adapter"]["base_bits"] == 8 and manifest["adapter"]["rank"] == RANK
