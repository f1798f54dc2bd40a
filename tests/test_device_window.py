"""Phones training full-forward windows: the ExecuTorch window program (the window's positions as inputs, the whole
frozen target in its data file, written there by the device, the window's values as its only parameters) trains through the runtime as
:class:`~fedfusion.models.full_forward.WindowModel` trains in torch, and one program serves a tier round after round
(new positions, a new frozen target); refusals of what it does not train are one line naming the setting."""

from __future__ import annotations

import pytest
import torch
from model_bounds import ExactLM, assert_replayed, assert_steps, batches, optimizer_steps, runtime_steps

from tests.test_device import QUICK

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEQ, STEPS, LR = 4, 16, 3, 1e-2


def tiny_config():
    """A 2-layer Llama of hidden 32 with grouped-query attention (8 heads on 4 kv groups of head_dim 4)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=4, max_position_embeddings=64)


def target_state(config, seed: int):
    from fedfusion.models.families import family_of

    torch.manual_seed(seed)
    return family_of(config).build(config).state_dict()


def window(config, server_round: int, shared: bool = False, axes: tuple[str, ...] = ("heads", "neurons")):
    """A quarter of the units on ``axes`` (kv groups, neurons), rolling: round 2 sits at a non-prefix offset."""
    from dataclasses import replace

    from fedfusion.models.slicing import plan_slice

    plan = plan_slice(config, 0.25, "rolling", server_round, stride=0.25, offset=0.25, axes=axes, scale=False)
    return replace(plan, shared=shared)


def payload(config, state, plan, frozen_dtype: str = "int8"):
    """A full-forward payload as SubModelMethod.payloads builds it: the frozen target under FROZEN keys in
    ``frozen_dtype`` and the window's exact values, with its WindowSpec."""
    from fedfusion.models.build import config_aliases, wire_state
    from fedfusion.models.slicing import extract
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.quantize import encode
    from fedfusion.wire.specs import WindowSpec

    frozen = {FROZEN + k: v for k, v in encode(wire_state(state, config_aliases(config)), frozen_dtype).items()}
    return {**extract(state, config, plan), **frozen}, WindowSpec(plan.assignment(), plan.shared)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(50, (32, SEQ + 1), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def program():
    """The tiny target's window program (its shape: 1 of 4 kv groups, 16 of 64 neurons), exported once."""
    from fedfusion.phone.window import export_window_program

    config = tiny_config()
    return export_window_program(config, window(config, 1), BATCH, SEQ)


def exact_window(config, received: dict[str, torch.Tensor], plan) -> ExactLM:
    """The float64 reference of a window payload: the frozen target as it arrived, the window trained."""
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.quantize import unpack

    frozen = unpack({k.removeprefix(FROZEN): v for k, v in received.items() if k.startswith(FROZEN)})
    return ExactLM(config, {k: p.value() for k, p in frozen.items()}, plan)


def torch_steps(config, received: dict[str, torch.Tensor], spec, windows: torch.Tensor):
    """STEPS torch steps of :class:`WindowModel` on the payload: each step's window values and gradient as the
    optimizer saw them (by sub-model name), and the loop's result."""
    from fedfusion.models.full_forward import from_payload
    from fedfusion.train.loop import train_steps

    model = from_payload(config, received, spec, seed=0)
    with optimizer_steps({sub: model.window[key] for sub, key in model._keys.items()}) as seen:
        result = train_steps(model, windows, STEPS, LR, BATCH, seed=11)
    return seen, result


def assert_round(runner, config, state, plan, windows, frozen_dtype: str = "int8") -> None:
    """STEPS runtime steps on this round's payload are WindowModel's: the same start, and at every step the loss and
    the gradient the runtime computed at the values it held are within float32's bounds of the exact ones on the
    step's batch, as torch's are (:mod:`model_bounds`, which says why the two loops' values after the steps are not
    compared); the runtime's optimizer moved the values by those gradients."""
    from fedfusion.phone.runtime import train_program
    from fedfusion.phone.window import window_frozen, window_round

    received, spec = payload(config, state, plan, frozen_dtype)
    runner.set_frozen(window_frozen(runner.manifest, received), f"{frozen_dtype} {plan.neurons[0]}")
    weights, inputs = window_round(runner.manifest, received, spec)
    runner.load(weights)
    runner.hold(inputs)
    with runtime_steps(runner) as mine:
        result = train_program(runner, windows, STEPS, LR, BATCH, seed=11)
    theirs, expected = torch_steps(config, received, spec, windows)
    assert all(torch.equal(mine[0][0][k], w) and torch.equal(theirs[0][0][k], w) for k, w in weights.items())
    exact, drawn = exact_window(config, received, plan), batches(windows, STEPS, BATCH, 11)
    assert_steps(exact, mine, result.losses, drawn)
    assert_steps(exact, theirs, expected.losses, drawn)
    assert_replayed(weights, mine, runner.params, "adamw", LR)


def test_window_model_steps_within_float32s_bounds(windows):
    """The torch path alone (no runtime): each of WindowModel's steps is within :class:`model_bounds.ExactLM`'s
    bounds of the float64 loss and gradient, and the bounds are tight enough to matter: a relative error of 1e-4 in
    the loss, or of 1e-3 in the gradient, is caught (the loss's bound is about 1.2e-5 of it; the gradient's worst
    entry here is below 1e-2 of its bound)."""
    config = tiny_config()
    plan = window(config, 2)
    received, spec = payload(config, target_state(config, 0), plan)
    steps, result = torch_steps(config, received, spec, windows)
    exact, drawn = exact_window(config, received, plan), batches(windows, STEPS, BATCH, 11)
    assert assert_steps(exact, steps, result.losses, drawn) <= 1
    with pytest.raises(AssertionError):
        assert_steps(exact, steps, [loss * (1 + 1e-4) for loss in result.losses], drawn)
    with pytest.raises(AssertionError):
        assert_steps(exact, [(theta, {k: g * (1 + 1e-3) for k, g in grads.items()}) for theta, grads in steps],
                     result.losses, drawn)


@pytest.mark.slow
@pytest.mark.device
def test_window_program_trains_as_window_model(program, windows):
    """One round at a non-prefix window on an int8 frozen target, through the runtime's AdamW."""
    from fedfusion.phone.runtime import ProgramRunner

    config = tiny_config()
    plan = window(config, 2)
    assert plan.attn_units == (2,) and plan.neurons == tuple(range(32, 48))
    runner = ProgramRunner(program)
    assert sorted(runner.params) == sorted(n for n in target_state(config, 0) if n.endswith("proj.weight"))
    assert_round(runner, config, target_state(config, 0), plan, windows)


@pytest.mark.slow
@pytest.mark.device
def test_one_window_program_serves_a_tier_round_after_round(program, windows):
    """The same program (and runner), a round later: the window moved and the frozen target changed (another
    folding of clients' updates), written into the same places of its data file: the loss and the steps are still
    WindowModel's. Per-round inputs are required and checked; a frozen target in another format than the program's
    (float16 into an int8 program), none, or a tensor of another shape, is refused."""
    from fedfusion.phone.runtime import ProgramRunner
    from fedfusion.phone.window import window_frozen

    config = tiny_config()
    runner = ProgramRunner(program)
    with pytest.raises(ValueError, match="hold"):
        runner.forward_backward(windows[:BATCH])
    state = target_state(config, 0)
    assert_round(runner, config, state, window(config, 2), windows)
    changed = {k: v + 0.02 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) for k, v in state.items()}
    plan = window(config, 3)
    assert plan.attn_units == (3,) and plan.neurons == tuple(range(48, 64))
    assert_round(runner, config, changed, plan, windows)
    held = {spec["name"]: value for spec, value in zip(runner.round_specs, runner.held)}
    received, spec = payload(config, changed, plan, "float16")
    with pytest.raises(ValueError, match="travelled as float16; this program takes it as int8"):
        window_frozen(runner.manifest, received)
    with pytest.raises(ValueError, match="none arrived"):
        window_frozen(runner.manifest, {})
    with pytest.raises(ValueError, match="units/heads"):  # a window of another shape is refused
        runner.hold({**held, "units/heads": torch.tensor([1, 2])})
    frozen = window_frozen(runner.manifest, payload(config, changed, plan)[0])
    name = next(iter(frozen))
    before = runner.program.ptd
    with pytest.raises(ValueError, match=f"{name}: torch.int8 \\(3,\\)"):
        runner.set_frozen({**frozen, name: torch.zeros(3, dtype=torch.int8)}, "bad")
    assert runner.program.ptd is before and runner.frozen_id != "bad"  # refused before anything changed

    def fail() -> None:
        raise RuntimeError("out of memory")

    runner._load = fail  # type: ignore[method-assign]  # a reload that fails (a phone out of memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.set_frozen(frozen, "next")
    assert runner.frozen_id == "" and not hasattr(runner, "module")  # holds no target under any id, nor a program


@pytest.mark.slow
@pytest.mark.device
def test_the_frozen_target_lives_in_the_data_file_once(program):
    """Held once: the frozen target is no input of the program (the runtime would copy inputs into its planned
    memory every step) but constants of its data file, each tensor in a segment of its own holding exactly its bytes,
    as it travelled (int8 codes, float16 scales and vectors: never float32), and every target tensor the window does
    not hold whole is there. Writing a target changes exactly those bytes of the data file and no others."""
    from fedfusion.phone.runtime import ProgramRunner
    from fedfusion.phone.window import window_frozen
    from fedfusion.wire.keys import FROZEN

    config = tiny_config()
    manifest = program.manifest
    places = manifest["window"]["frozen"]
    assert not any(i["name"].startswith(FROZEN) for i in manifest["inputs"])
    assert {p["dtype"] for p in places} == {"int8", "float16"}
    assert manifest["window"]["frozen_bytes"] == sum(p["bytes"] for p in places) <= len(program.ptd)
    spans = sorted((p["offset"], p["offset"] + p["bytes"]) for p in places)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two share a byte
    received, _ = payload(config, target_state(config, 4), window(config, 2))
    frozen = window_frozen(manifest, received)
    assert {n.removeprefix(FROZEN).split("::")[0] for n in frozen} == set(target_state(config, 0))  # nothing shared
    runner = ProgramRunner(program)
    before = runner.program.ptd
    runner.set_frozen(frozen, "t4")
    after = runner.program.ptd
    assert len(after) == len(before) and runner.frozen_id == "t4"
    inside = torch.zeros(len(after), dtype=torch.bool)
    for p in places:
        start, end = p["offset"], p["offset"] + p["bytes"]
        assert after[start:end] == frozen[p["name"]].contiguous().view(torch.uint8).numpy().tobytes()
        inside[start:end] = True
    old, new = torch.frombuffer(bytearray(before), dtype=torch.uint8), torch.frombuffer(bytearray(after), dtype=torch.uint8)
    assert torch.equal(old[~inside], new[~inside])


@pytest.mark.slow
@pytest.mark.device
def test_a_device_keeps_the_frozen_target_until_it_changes(program, windows, tmp_path, monkeypatch):
    """Through a gateway and the reference device, four window tasks on the tiny target whose frozen targets are
    a, a again (a second task of a round), b (the target changed) and a. The device fetches the target for tasks 1, 3
    and 4 only; task 2 trains on the copy task 1 fetched and ends where task 1 did, bit for bit, as task 4 does from
    a fresh fetch; task 3 ends elsewhere. The device keeps no decoded target: its one copy is the program's data file,
    holding a's bytes as they travelled (never float32), and the program's held inputs are only the window's
    positions; the gateway forgets each target once its tasks are collected."""
    import json
    import threading

    import fedfusion.data.population as population
    from fedfusion.phone.gateway import Gateway, GatewayServer, Tokens, call, frozen_hash, pack, split_frozen, unpack, write_tokens
    from fedfusion.phone.reference import ReferenceDevice
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.specs import ClientSpec, RoundSpec, TrainSpec, merge

    monkeypatch.setattr(population, "client_windows", lambda *args: windows)  # the tiny target's vocabulary
    config = tiny_config()
    plan = window(config, 2)
    tokens, programs = tmp_path / "tokens.json", tmp_path / "programs"
    secret = write_tokens(tokens, {"tok-a": "phone-a"})
    program.save(programs)
    gateway = Gateway(Tokens(tokens), programs)
    server = GatewayServer(("127.0.0.1", 0), gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    device, said, sent, results = ReferenceDevice(server.url, "tok-a"), list[str](), [], []
    try:
        for seed in (0, 0, 1, 0):
            received, spec = payload(config, target_state(config, seed), plan)
            task_spec = merge(ClientSpec("windows", SEQ, 1), TrainSpec(STEPS, LR, BATCH, 0.0, "adamw"),
                              RoundSpec(2, 11), spec)
            task_spec["partition"] = 0
            body = pack(received, {"spec": task_spec, "deadline_s": 300, "model_config": config.to_dict(),
                                   "window": True})
            status, answer = call(f"{server.url}/v1/node/tasks", "POST", secret, body)
            assert status == 200, answer
            sent.append((json.loads(answer)["task"], frozen_hash(pack(split_frozen(received)[0], {}))))
        assert len(list(programs.glob("*.json"))) == 1  # found by its key, not exported again
        assert device.serve(tasks=4, poll_s=0.05, echo=said.append) == 4
        runner = device.runners[program.program_id]
        held = dict(zip((s["name"] for s in runner.round_specs), runner.held))
        for task, _ in sent:
            status, body = call(f"{server.url}/v1/node/tasks/{task}?wait=5", "GET", secret)
            assert status == 200, body
            results.append(unpack(body)[0])
    finally:
        server.shutdown()
        server.server_close()
    ha, hb = sent[0][1], sent[2][1]
    assert ha == sent[1][1] == sent[3][1] != hb and device.fetched == [ha, hb, ha]
    assert [line.rsplit(", ", 1)[1] for line in said[1:]] == ["frozen target fetched", "frozen target held",
                                                               "frozen target fetched", "frozen target fetched"]
    assert runner.frozen_id == ha and not hasattr(device, "frozen")
    assert held and not any(k.startswith(FROZEN) for k in held)
    a = split_frozen(payload(config, target_state(config, 0), plan)[0])[0]
    places = runner.manifest["window"]["frozen"]
    assert {p["dtype"] for p in places} == {"int8", "float16"}  # never a float32 copy
    for p in places:
        data = runner.program.ptd[p["offset"]:p["offset"] + p["bytes"]]
        assert data == a[p["name"]].contiguous().view(torch.uint8).numpy().tobytes()
    assert all(torch.equal(results[1][k], v) and torch.equal(results[3][k], v) for k, v in results[0].items())
    assert any(not torch.equal(results[2][k], v) for k, v in results[0].items())
    assert gateway.frozen == {}


@pytest.mark.slow
@pytest.mark.device
def test_shared_window_trains_the_embeddings_whole(windows):
    """With ``window_shared`` the embeddings, norms and head are parameters (the window holds them whole) and no
    place in the data file; parity holds for them too, here on a frozen target that travels (and sits in the data
    file) as float16."""
    from fedfusion.phone.runtime import ProgramRunner
    from fedfusion.phone.window import export_window_program

    config = tiny_config()
    program = export_window_program(config, window(config, 1, shared=True), BATCH, SEQ, frozen_dtype="float16")
    places = {p["name"]: p["dtype"] for p in program.manifest["window"]["frozen"]}
    assert "frozen/model.embed_tokens.weight" not in places
    assert places["frozen/model.layers.0.mlp.up_proj.weight"] == "float16"
    runner = ProgramRunner(program)
    assert "model.embed_tokens.weight" in runner.params and "lm_head.weight" in runner.params
    assert_round(runner, config, target_state(config, 0), window(config, 2, shared=True), windows, "float16")


@pytest.mark.slow
@pytest.mark.device
def test_gpt2_shared_window_trains_its_tied_head():
    """GPT-2 (Conv1D matrices, biases, a head tied to the embedding), a window of neurons (its heads slice only with
    the hidden axis) with the shared tensors: the tied embedding is one parameter whose gradient sums both uses. Its
    frozen target travels as packed int4 (two codes a byte), which the program unpacks itself."""
    from transformers import GPT2Config

    from fedfusion.phone.runtime import ProgramRunner
    from fedfusion.phone.window import export_window_program

    config = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    plan = window(config, 1, shared=True, axes=("neurons",))
    runner = ProgramRunner(export_window_program(config, plan, BATCH, SEQ, frozen_dtype="int4"))
    assert "transformer.wte.weight" in runner.params and "lm_head.weight" not in runner.params
    assert {i["dtype"] for i in runner.round_specs} == {"int64"}  # the positions; the target is in the data file
    assert {p["dtype"] for p in runner.manifest["window"]["frozen"]} == {"uint8", "float16"}
    windows = torch.randint(50, (32, SEQ + 1), generator=torch.Generator().manual_seed(3))
    assert_round(runner, config, target_state(config, 0), window(config, 2, shared=True, axes=("neurons",)), windows,
                 "int4")


@pytest.mark.slow
@pytest.mark.device
def test_export_device_command_writes_a_window_program(tmp_path, capsys):
    """``fedfusion export-device`` with ``fusion.forward=full``: the rolling recipe's phone tier's window (2 layers
    here), its three files and its manifest's per-round inputs."""
    from fedfusion.cli import main
    from fedfusion.phone.program import DeviceProgram
    from fedfusion.phone.runtime import ProgramRunner

    out = tmp_path / "programs"
    assert main(["export-device", "rolling", "fusion.forward=full", *QUICK, "--tier", "phone", "--out", str(out)]) == 0
    assert "phone (rounds 1..12): full-forward window (" in capsys.readouterr().out
    program = DeviceProgram.load(out, next(out.glob("*.json")).stem)
    m = program.manifest
    assert m["window"]["per_layer"] == {"heads": 1, "neurons": 64} and not m["window"]["shared"]
    assert [i["name"] for i in m["inputs"][:3]] == ["tokens", "units/heads", "units/neurons"]
    assert sorted(ProgramRunner(program).params) == sorted(p["name"] for p in m["parameters"])


@pytest.mark.slow
@pytest.mark.device
def test_export_device_writes_the_quickstarts_two_phases_for_a_phone(tmp_path, capsys):
    """The quickstart with windows drawn outside the core exports for a phone: the small model's slice program for
    rounds 1..4 (what the rounds before growth send) and the grown phase's window program (core + window, one shape
    every round) for rounds 5..12, each a program a runner loads."""
    from fedfusion.cli import main
    from fedfusion.phone.program import DeviceProgram
    from fedfusion.phone.runtime import ProgramRunner

    out = tmp_path / "programs"
    args = ["export-device", "quickstart", "fusion.window_outside_core=true", *QUICK, "--tier", "phone", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "phone (rounds 1..4): llama sub-model, " in printed
    assert "phone (rounds 5..12): full-forward window (" in printed and "shared tensors" in printed
    manifests = {DeviceProgram.load(out, p.stem).manifest.get("window") is not None: p.stem for p in out.glob("*.json")}
    assert set(manifests) == {True, False}
    window = DeviceProgram.load(out, manifests[True])
    assert window.manifest["window"]["per_layer"] == {"heads": 2, "neurons": 128}  # core 1 + 1 of 8 heads; 64 + 64
    for program in manifests.values():
        runner = ProgramRunner(DeviceProgram.load(out, program))
        assert runner.params


@pytest.mark.parametrize("overrides,setting", [
    (["fusion.window_rank=2"], "fusion.window_rank=2"),
    (["fusion.window_core=true"], "fusion.window_core=true"),
    (["fusion.window_core=true", "fusion.window_outside_core=true", "fusion.window_shared=true",
      "fusion.core_forward=small"], "fusion.core_forward=small"),
    (["fusion.axes=[heads,neurons,depth]"], "fusion.axes with depth"),
])
def test_export_device_names_what_blocks_a_window(overrides, setting):
    """A full-forward setting the window program does not train is refused in one line that starts with it."""
    from fedfusion.config.recipe import load_recipe
    from fedfusion.phone.commands import check_tier

    recipe = load_recipe("rolling", ["fusion.forward=full", *overrides])
    with pytest.raises(ValueError) as refused:
        check_tier(recipe, "phone")
    message = str(refused.value)
    assert message.startswith(setting + ":") and "\n" not in message


def test_a_core_window_drawn_outside_the_core_is_the_programs_one_shape_every_round():
    """The quickstart with fusion.window_outside_core: every round after growth, each tier's window (the core plus a
    window drawn outside it) has the shape the exported program is built for (phone: the core's 1 head and 16
    neurons plus 1 and 16 more, of 8 heads and 128 neurons a layer here), so export-device accepts the recipe."""
    from fedfusion.config.recipe import load_recipe
    from fedfusion.fusion.base import Client
    from fedfusion.fusion.submodel.method import SubModelMethod
    from fedfusion.models.families import family_of
    from fedfusion.phone.commands import check_tier, tier_config, tier_window

    recipe = load_recipe("quickstart", ["fusion.window_outside_core=true", "model.intermediate_size=128"])
    check_tier(recipe, "phone")
    config = tier_config(recipe, "phone")
    f = recipe.fusion
    state = family_of(config).build(config).state_dict()
    method = SubModelMethod(config, dict(f.widths), state, forward="full", policy=f.policy, stride=f.stride,
                            axes=tuple(f.axes), scale=False, window_core=True, window_shared=True, outside_core=True,
                            grow_round=4)
    for tier in f.widths:
        want = tier_window(recipe, tier, config)
        for server_round in range(5, 13):
            [payload] = method.payloads(server_round, state, [Client(partition=1, tier=tier, seed=1)])
            plan = payload.context[0]
            assert [len(getattr(plan, a)) for a in ("attn_units", "neurons")] == \
                [len(getattr(want, a)) for a in ("attn_units", "neurons")]
            assert plan.shared == want.shared
    phone = tier_window(recipe, "phone", config)
    assert (len(phone.attn_units), len(phone.neurons)) == (2, 32)
