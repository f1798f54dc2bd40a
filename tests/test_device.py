"""Phones as clients: the client-code optimizer, the gateway's API and refusals (fast), and, with an exported
ExecuTorch program (slow: an export takes tens of seconds on 2 cores), runtime-vs-torch parity and a gateway +
reference device round trip as a SuperNode would drive it."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from fp_bounds import assert_within, gamma
from model_bounds import ExactLM, assert_replayed, assert_steps, batches, optimizer_steps, runtime_steps

from fedfusion.phone.gateway import Gateway, GatewayServer, Tokens, call, pack, unpack, write_tokens
from fedfusion.phone.runtime import ClientOptimizer
from fedfusion.train.loop import make_optimizer

QUICK = ["model.num_layers=2", "train.batch_size=4", "train.seq_len=16", "train.local_steps=4"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,wd", [("adamw", 0.0), ("adamw", 0.1), ("sgd", 0.01)])
def test_client_optimizer_steps_as_torch(name, wd, dtype):
    """The optimizer a phone runs over named gradients moves weights as torch.optim does, step for step, within
    rounding. AdamW's moments are the same torch ops on the same gradients (equal, bit for bit: asserted); from equal
    inputs each side's new weight is within gamma_3 |p| (the decay's scalar and product, the final sum) plus
    gamma_8 |update| (the bias corrections' square root, taken as ``** 0.5`` by torch and ``math.sqrt`` here, each
    within an ulp; the moment's root, the two divisions, eps, the step size, the product, the final sum) of the exact
    step, so the two sides within twice that; a difference carried from the step before is scaled by 1 - lr wd <= 1
    (the update does not depend on the weight; SGD's decay is that factor). Bounds in float64 from torch's values."""
    gen = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(5, 3, generator=gen, dtype=dtype), "b": torch.randn(7, generator=gen, dtype=dtype)}
    module = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone()) for k, v in start.items()})
    lr = 0.01
    opt = make_optimizer(module, name, lr, wd)
    mine, client = {k: v.clone() for k, v in start.items()}, ClientOptimizer(name, lr, wd)
    bound = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in start.items()}
    b1, b2 = client.betas
    for step in range(1, 7):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in start.items()}
        before = {k: p.detach().double().clone() for k, p in module.items()}
        for k, p in module.items():
            p.grad = grads[k].clone()
        opt.step()
        client.step(mine, grads)
        for k, p in module.items():
            if name == "adamw":
                m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
                assert torch.equal(m, client.moments[k][0]) and torch.equal(v, client.moments[k][1])
                root = v.double().sqrt() / math.sqrt(1 - b2 ** step)
                update = lr / (1 - b1 ** step) * m.double().abs() / (root + client.eps)
            else:
                update = lr * (grads[k].double().abs() + wd * before[k].abs())
            bound[k] += 2 * (gamma(3, dtype) * before[k].abs() + gamma(8, dtype) * update)
            assert_within(mine[k], p, bound[k])
    for k in start:
        assert not torch.equal(mine[k], start[k])


def test_pack_round_trip_and_garbage():
    tensors = {"w": torch.arange(6.0).view(2, 3)}
    back, meta = unpack(pack(tensors, {"metrics": {"train_loss": 1.5}}))
    assert torch.equal(back["w"], tensors["w"]) and meta == {"metrics": {"train_loss": 1.5}}
    with pytest.raises(ValueError, match="safetensors"):
        unpack(b"\x05\x00\x00\x00\x00\x00\x00\x00garbage")


def test_a_frozen_target_crosses_the_gateway_as_it_travelled():
    """A window task's frozen target (int8 codes, float16 scales, integer shapes) is packed as it is, so the device
    decodes exactly what the SuperNode received; other floating tensors go as float32."""
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.quantize import decode, encode

    frozen = {FROZEN + k: v for k, v in encode({"m": torch.randn(8, 64)}, "int8").items()}
    back, _ = unpack(pack({**frozen, "w": torch.ones(2, dtype=torch.bfloat16)}, {}))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in frozen.items())
    assert back["w"].dtype == torch.float32
    assert torch.equal(decode({k.removeprefix(FROZEN): v for k, v in back.items() if k.startswith(FROZEN)})["m"],
                       decode({k.removeprefix(FROZEN): v for k, v in frozen.items()})["m"])


@pytest.fixture
def gateway(tmp_path):
    """A gateway on a loopback port with devices A and B; programs/ holds a stand-in manifest so tasks need no export."""
    tokens = tmp_path / "tokens.json"
    secret = write_tokens(tokens, {"tok-a": "phone-a", "tok-b": "phone-b"})
    programs = tmp_path / "programs"
    programs.mkdir()
    gw = Gateway(Tokens(tokens), programs)
    gw.program_for = lambda *args: "abc123"  # no export in the fast tests: the program's id is all a task holds
    server = GatewayServer(("127.0.0.1", 0), gw)
    # shutdown() waits for serve_forever's next poll: at its default 0.5 s that was half a second of each test
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server, secret, tokens
    server.shutdown()
    server.server_close()


def _submit(url: str, secret: str, deadline_s: float) -> str:
    body = pack({"w": torch.ones(2)}, {"spec": {"batch-size": 4, "seq-len": 16}, "model_config": {},
                                       "deadline_s": deadline_s})
    status, answer = call(f"{url}/v1/node/tasks", "POST", secret, body)
    assert status == 200, answer
    return json.loads(answer)["task"]


def test_gateway_refuses_unknown_and_revoked_tokens(gateway):
    server, secret, tokens = gateway
    url = server.url
    assert call(f"{url}/v1/register", "POST", "nope", b"")[0] == 401
    assert call(f"{url}/v1/node/tasks", "POST", "tok-a", b"")[0] == 401  # a device token is no node secret
    assert call(f"{url}/v1/register", "POST", "tok-a", b"")[0] == 200
    data = json.loads(tokens.read_text())
    data["revoked"] = ["tok-a"]
    tokens.write_text(json.dumps(data))
    import os

    os.utime(tokens, (time.time() + 5, time.time() + 5))  # a new mtime even within the file system's resolution
    assert call(f"{url}/v1/register", "POST", "tok-a", b"")[0] == 403
    assert call(f"{url}/v1/task", "GET", "tok-a")[0] == 403
    assert call(f"{url}/v1/register", "POST", "tok-b", b"")[0] == 200


@pytest.mark.slow  # waits out the device's idle time on real sockets (~3.5 s)
def test_a_device_outlives_its_gateway_going_away(gateway):
    """The gateway shuts down while a device polls it: the device says so once and keeps polling (idle time); a
    gateway restarted on the same address gets it registered again; ``idle_s`` still ends it; nothing is raised in
    its thread."""
    from fedfusion.phone.reference import ReferenceDevice

    server, _, tokens = gateway
    said: list[str] = []
    device = ReferenceDevice(server.url, "tok-a")
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(device.serve(poll_s=0.05, idle_s=3.0, echo=said.append)))
    worker.start()
    time.sleep(0.3)  # registered and polling
    server.shutdown()
    server.server_close()
    time.sleep(0.5)  # unreachable for a while
    again = GatewayServer(server.server_address, Gateway(Tokens(tokens), tokens.parent / "programs"))
    threading.Thread(target=again.serve_forever, daemon=True).start()
    try:
        worker.join(timeout=30)
        assert result == [0] and not worker.is_alive()
        assert said[0].startswith("registered with") and sum("unreachable" in line for line in said) == 1
        assert any(line.startswith(f"gateway {server.url} answers again; registered as phone-a") for line in said)
        assert call(f"{server.url}/v1/task", "GET", "tok-a")[0] == 204  # registered with the new gateway
    finally:
        again.shutdown()
        again.server_close()


@pytest.mark.device
def test_the_device_command_names_a_gateway_it_cannot_reach(capsys):
    """`fedfusion device` against a port nothing listens on: one line naming the gateway, exit code 4."""
    import socket

    from fedfusion.cli import main

    with socket.socket() as probe:  # a free port, closed again: connecting to it is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert main(["device", "--gateway", url, "--token", "tok-a"]) == 4
    assert f"error: gateway {url} unreachable" in capsys.readouterr().out


def test_gateway_task_life_cycle(gateway):
    """A task goes to one device; another device cannot read or answer it; a result comes back to the node."""
    server, secret, _ = gateway
    url = server.url
    assert call(f"{url}/v1/task", "GET", "tok-a")[0] == 403  # not registered yet
    for token in ("tok-a", "tok-b"):
        call(f"{url}/v1/register", "POST", token, b"")
    assert call(f"{url}/v1/task", "GET", "tok-a")[0] == 204
    task = _submit(url, secret, 30)
    status, body = call(f"{url}/v1/task", "GET", "tok-a")
    assert status == 200 and json.loads(body)["program"] == "abc123"
    assert call(f"{url}/v1/task", "GET", "tok-b")[0] == 204  # taken
    assert call(f"{url}/v1/tasks/{task}/weights", "GET", "tok-b")[0] == 403
    weights, _ = unpack(call(f"{url}/v1/tasks/{task}/weights", "GET", "tok-a")[1])
    assert torch.equal(weights["w"], torch.ones(2))
    assert call(f"{url}/v1/node/tasks/{task}?wait=0", "GET", secret)[0] == 202
    assert call(f"{url}/v1/tasks/{task}/result", "POST", "tok-a", pack({"w": torch.zeros(2)}, {}))[0] == 400  # no metrics
    result = pack({"w": torch.zeros(2)}, {"metrics": {"train_loss": 2.0}})
    assert call(f"{url}/v1/tasks/{task}/result", "POST", "tok-a", result)[0] == 200
    status, body = call(f"{url}/v1/node/tasks/{task}?wait=5", "GET", secret)
    tensors, meta = unpack(body)
    assert status == 200 and torch.equal(tensors["w"], torch.zeros(2)) and meta["metrics"]["train_loss"] == 2.0
    assert call(f"{url}/v1/node/tasks/{task}?wait=0", "GET", secret)[0] == 404  # delivered, then forgotten


def test_a_device_that_cannot_train_a_task_says_why_and_keeps_serving(gateway):
    """A task the device cannot train (a malformed payload, a program it cannot fetch) is reported to the gateway:
    the node hears the device's reason at once, not at the deadline; the device goes on serving; a second report
    of the same task is refused (409)."""
    from fedfusion.phone.reference import ReferenceDevice

    server, secret, _ = gateway
    url = server.url
    device = ReferenceDevice(url, "tok-a")
    failures = iter([ValueError("a full-forward payload without its frozen target"), RuntimeError("no program")])

    def run_task(task: dict) -> dict:
        raise next(failures)

    device.run_task = run_task  # type: ignore[method-assign]
    tasks = [_submit(url, secret, 60), _submit(url, secret, 60)]
    start = time.monotonic()
    said: list[str] = []
    assert device.serve(poll_s=0.05, idle_s=0.5, echo=said.append) == 0
    for task, reason in zip(tasks, ("ValueError: a full-forward payload", "RuntimeError: no program")):
        status, body = call(f"{url}/v1/node/tasks/{task}?wait=5", "GET", secret)
        assert status == 410 and f"device phone-a could not train the task: {reason}" in json.loads(body)["reason"]
        assert call(f"{url}/v1/tasks/{task}/error", "POST", "tok-a", b'{"error": "again"}')[0] == 409
    assert time.monotonic() - start < 30  # long before the 60 s deadline
    assert sum(line.startswith("task ") for line in said) == 2


def test_gateway_drops_a_task_past_its_deadline(gateway):
    """A device that takes a task and goes silent makes it a dropout; its late result is refused (409)."""
    server, secret, _ = gateway
    url = server.url
    call(f"{url}/v1/register", "POST", "tok-a", b"")
    task = _submit(url, secret, 0.5)
    assert call(f"{url}/v1/task", "GET", "tok-a")[0] == 200
    status, body = call(f"{url}/v1/node/tasks/{task}?wait=5", "GET", secret)
    assert status == 410 and "phone-a" in json.loads(body)["reason"]
    late = pack({"w": torch.zeros(2)}, {"metrics": {"train_loss": 1.0}})
    assert call(f"{url}/v1/tasks/{task}/result", "POST", "tok-a", late)[0] == 409
    untaken = _submit(url, secret, 0.2)
    status, body = call(f"{url}/v1/node/tasks/{untaken}?wait=5", "GET", secret)
    assert status == 410 and "no device took" in json.loads(body)["reason"]


def _frozen(seed: int) -> dict[str, torch.Tensor]:
    """A frozen target as a window task carries it: int8 codes, float16 scales and shapes under FROZEN keys."""
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.quantize import encode

    gen = torch.Generator().manual_seed(seed)
    return {FROZEN + k: v for k, v in encode({"m": torch.randn(8, 64, generator=gen), "g": torch.ones(8)}, "int8").items()}


def _submit_window(url: str, secret: str, frozen: dict[str, torch.Tensor], deadline_s: float = 60) -> str:
    body = pack({"w": torch.ones(2), **frozen}, {"spec": {"batch-size": 4, "seq-len": 16}, "model_config": {},
                                                 "window": True, "deadline_s": deadline_s})
    status, answer = call(f"{url}/v1/node/tasks", "POST", secret, body)
    assert status == 200, answer
    return json.loads(answer)["task"]


def _take(url: str, token: str) -> dict:
    status, body = call(f"{url}/v1/task", "GET", token)
    assert status == 200, body
    return json.loads(body)


def test_a_frozen_target_is_sent_once_per_change_and_checked_by_hash(gateway):
    """Window tasks name their frozen target's hash and carry their weights without it; the gateway keeps one copy
    per hash (two tasks of a round share one) and forgets it once no task needs it. A device fetches a target only
    when the hash differs from the one its program holds: a second task on the same target fetches nothing, a
    changed target is fetched. Another device's task's target is refused; a task without one
    has none to fetch."""
    from fedfusion.phone.gateway import frozen_hash
    from fedfusion.phone.reference import ReferenceDevice
    from fedfusion.wire.keys import FROZEN

    server, secret, _ = gateway
    url, gw = server.url, server.gateway
    gw.window_program_for = lambda *args: "abc123"
    a, b = _frozen(1), _frozen(2)
    ha, hb = frozen_hash(pack(a, {})), frozen_hash(pack(b, {}))
    assert ha != hb and frozen_hash(pack(_frozen(1), {})) == ha and len(ha) == 64  # the same tensors, the same bytes
    tasks = [_submit_window(url, secret, a), _submit_window(url, secret, a), _submit_window(url, secret, b)]
    assert sorted(gw.frozen) == sorted([ha, hb])  # the first two tasks share one copy
    plain = _submit(url, secret, 60)
    device = ReferenceDevice(url, "tok-a")
    device.register()
    call(f"{url}/v1/register", "POST", "tok-b", b"")
    taken = [_take(url, "tok-a") for _ in tasks]
    assert [t["task"] for t in taken] == tasks and [t["frozen"] for t in taken] == [ha, ha, hb]
    weights, _ = unpack(call(f"{url}/v1/tasks/{tasks[0]}/weights", "GET", "tok-a")[1])
    assert list(weights) == ["w"]  # the frozen target travels apart from the weights
    assert call(f"{url}/v1/tasks/{tasks[0]}/frozen", "GET", "tok-b")[0] == 403
    first = device.frozen_target(taken[0])
    assert first.keys() == a.keys() and all(torch.equal(first[k], v) and first[k].dtype == v.dtype for k, v in a.items())
    assert device.frozen_target(taken[1], held=ha) is None and device.fetched == [ha]  # held: not fetched again
    second = device.frozen_target(taken[2], held=ha)
    assert second is not None
    assert device.fetched == [ha, hb] and not torch.equal(second[FROZEN + "m::q"], first[FROZEN + "m::q"])
    untaken = _take(url, "tok-b")
    assert untaken["task"] == plain and "frozen" not in untaken
    assert call(f"{url}/v1/tasks/{plain}/frozen", "GET", "tok-b")[0] == 404
    done = pack({"w": torch.zeros(2)}, {"metrics": {"train_loss": 1.0}})
    for task in tasks[:2]:
        assert call(f"{url}/v1/tasks/{task}/result", "POST", "tok-a", done)[0] == 200
        assert call(f"{url}/v1/node/tasks/{task}?wait=5", "GET", secret)[0] == 200
    assert sorted(gw.frozen) == [hb]  # target a: no task needs it any more
    assert call(f"{url}/v1/tasks/{tasks[2]}/error", "POST", "tok-a", b'{"error": "x"}')[0] == 200
    assert call(f"{url}/v1/node/tasks/{tasks[2]}?wait=5", "GET", secret)[0] == 410
    assert gw.frozen == {}
    assert call(f"{url}/v1/tasks/{tasks[2]}/frozen", "GET", "tok-a")[0] == 409  # dropped: nothing to fetch


def test_a_frozen_target_that_does_not_match_its_hash_is_refused(gateway):
    """A frozen target whose bytes are not the ones its task's hash names (here: another target's, swapped in at
    the gateway) is refused by the device, which keeps nothing of it (``serve`` reports the error, so the node hears
    it at once); the next task on that hash is fetched afresh."""
    from fedfusion.phone.gateway import frozen_hash
    from fedfusion.phone.reference import FrozenMismatch, ReferenceDevice

    server, secret, _ = gateway
    url, gw = server.url, server.gateway
    gw.window_program_for = lambda *args: "abc123"
    a, b = _frozen(1), _frozen(2)
    ha = frozen_hash(pack(a, {}))
    task = _submit_window(url, secret, a)
    gw.frozen[ha] = pack(b, {})
    device = ReferenceDevice(url, "tok-a")
    device.register()
    taken = _take(url, "tok-a")
    with pytest.raises(FrozenMismatch, match=f"hashes to {frozen_hash(pack(b, {}))[:16]}, the task names {ha[:16]}: refused"):
        device.frozen_target(taken)
    assert device.fetched == [ha]
    assert call(f"{url}/v1/tasks/{task}/error", "POST", "tok-a", b'{"error": "x"}')[0] == 200
    gw.frozen[ha] = pack(a, {})  # the right bytes again: the next task's target is fetched afresh and kept
    _submit_window(url, secret, a)
    kept = device.frozen_target(_take(url, "tok-a"))
    assert device.fetched == [ha, ha] and kept is not None
    assert all(torch.equal(kept[k], v) and kept[k].dtype == v.dtype for k, v in a.items())


def test_export_device_refuses_a_tier_without_a_width():
    from fedfusion.config.recipe import load_recipe
    from fedfusion.phone.commands import tier_config

    with pytest.raises(ValueError, match="--tier 'watch'"):
        tier_config(load_recipe("quickstart"), "watch")
    with pytest.raises(ValueError, match="fusion.method .distill."):
        tier_config(load_recipe("distill"), "phone")


def test_export_device_command_reports_a_bad_tier_before_writing(tmp_path, capsys, monkeypatch):
    from fedfusion.cli import main
    from fedfusion.phone import commands

    monkeypatch.setattr(commands, "find_spec", lambda name: True)  # as if the device extra were installed
    assert main(["export-device", "quickstart", "--tier", "watch", "--out", str(tmp_path / "p")]) == 2
    assert "--tier 'watch'" in capsys.readouterr().out and not (tmp_path / "p").exists()


# -- with ExecuTorch (the [device] extra) -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def phone_program(tmp_path_factory):
    """The rolling recipe's phone tier's program (2 layers, batch 4 x 16 tokens), exported once for the device tests."""
    from fedfusion.config.recipe import load_recipe
    from fedfusion.phone.commands import export_tier

    recipe = load_recipe("rolling", QUICK)
    out = tmp_path_factory.mktemp("programs")
    program = export_tier(recipe, "phone")
    program.save(out)
    return recipe, program, out


def _phone_state(recipe, server_round: int = 3):
    """A rolling slice of a seeded rolling-recipe target, as the strategy sends it, with its sub-model config."""
    from fedfusion.data.text import load_tokenizer
    from fedfusion.models.build import build_target
    from fedfusion.models.slicing import extract, plan_slice, sub_config

    target = build_target(recipe.model, load_tokenizer(None), recipe.seed)
    plan = plan_slice(target.config, recipe.fusion.widths["phone"], "rolling", server_round, recipe.fusion.stride)
    return extract(target.state_dict(), target.config, plan), sub_config(target.config, plan)


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_runtime_training_matches_torch(phone_program, optimizer):
    """k steps through the ExecuTorch program (client-code optimizer, no autograd) are k torch steps: at every step
    the loss and gradient each loop computed at the values it held are within float32's bounds of the exact ones on
    the step's batch (:mod:`model_bounds`), and the runtime stepped by its gradients; and the loss falls."""
    from fedfusion.data.population import client_windows, data_spec
    from fedfusion.data.text import sample_batch
    from fedfusion.models.build import model_from_state
    from fedfusion.phone.runtime import ProgramRunner, train_program
    from fedfusion.train.loop import lm_loss, optimizer_step

    recipe, program, _ = phone_program
    state, config = _phone_state(recipe)
    windows = client_windows(data_spec(recipe.data_source()), 0, recipe.train.seq_len, "train")
    steps, lr, batch = 8, (3e-3 if optimizer == "adamw" else 0.1), recipe.train.batch_size

    runner = ProgramRunner(program)
    runner.load(state)
    with runtime_steps(runner) as mine:
        stats = train_program(runner, windows, steps, lr, batch, seed=11, optimizer=optimizer)

    model = model_from_state(config, state)
    opt, gen, losses = make_optimizer(model, optimizer, lr, 0.0), torch.Generator().manual_seed(11), []
    with optimizer_steps(dict(model.named_parameters())) as theirs:
        for _ in range(steps):
            losses.append(optimizer_step(opt, lm_loss(model, sample_batch(windows, batch, gen))[0]))

    exact, drawn = ExactLM(config, state), batches(windows, steps, batch, 11)
    assert_steps(exact, mine, stats.losses, drawn)
    assert_steps(exact, theirs, losses, drawn)
    assert_replayed(state, mine, runner.params, optimizer, lr)
    assert sum(losses[-3:]) / 3 < losses[0]


@pytest.mark.slow
@pytest.mark.device
def test_manifest_describes_the_program(phone_program):
    recipe, program, out = phone_program
    m = program.manifest
    state, _ = _phone_state(recipe)
    assert {p["name"]: p["shape"] for p in m["parameters"]} == {k: list(v.shape) for k, v in state.items()}
    assert m["inputs"] == [{"name": "tokens", "shape": [4, 17], "dtype": "int64"}]
    assert m["optimizer"]["name"] == recipe.train.optimizer and m["optimizer"]["lr"] == recipe.train.lr
    assert (out / f"{program.program_id}.pte").stat().st_size == len(program.pte)
    # weights are not baked in: the program is far smaller than its float32 parameters
    assert len(program.pte) < sum(4 * v.numel() for v in state.values()) <= len(program.ptd)


@pytest.mark.slow
@pytest.mark.device
def test_gateway_and_reference_device_end_to_end(phone_program, tmp_path):
    """A SuperNode's relay hands a message to the gateway, the reference device trains it through the runtime, and
    the node gets an update of the sub-model's keys; a device killed mid-task makes the next one a dropout."""
    from fedfusion.clients.device import DeviceDropped, relay
    from flwr.app import ConfigRecord

    from fedfusion.data.population import data_spec
    from fedfusion.phone.reference import DeviceRefused, ReferenceDevice
    from fedfusion.wire.specs import DROPPED, ClientSpec, ModelSpec, RoleSpec, RoundSpec, SliceSpec, TrainSpec, merge

    recipe, program, programs = phone_program
    tokens = tmp_path / "tokens.json"
    secret = write_tokens(tokens, {"tok-a": "phone-a"})
    (tmp_path / "secret").write_text(secret)
    server = GatewayServer(("127.0.0.1", 0), Gateway(Tokens(tokens), programs))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(DeviceRefused, match="401"):
            ReferenceDevice(server.url, "wrong").register()
        state, config = _phone_state(recipe)
        spec = ConfigRecord(merge(TrainSpec.from_recipe(recipe.train), RoundSpec(3, 5), RoleSpec("submodel"),
                                  ClientSpec(data_spec(recipe.data_source()), recipe.train.seq_len, 1), SliceSpec(0.125, "rolling", None),
                                  ModelSpec(config.to_dict())))
        node = {"gateway": server.url, "gateway-secret-file": str(tmp_path / "secret"), "gateway-deadline-s": 60.0}
        device = ReferenceDevice(server.url, "tok-a")
        worker = threading.Thread(target=device.serve, kwargs={"tasks": 1, "poll_s": 0.1, "echo": lambda s: None})
        worker.start()
        new, metrics = relay(state, spec, 2, node)
        worker.join(timeout=60)
        assert set(new) == set(state) and all(new[k].shape == state[k].shape for k in state)
        assert any(not torch.equal(new[k], state[k]) for k in state)
        assert metrics["num-examples"] > 0 and metrics["train_tokens"] == recipe.train.local_steps * 4 * 16
        # a device that takes the task and dies: the node's reply is a dropout, not a hang
        node["gateway-deadline-s"] = 1.0
        killed = threading.Thread(target=lambda: _take_and_vanish(server.url, "tok-a"))
        killed.start()
        with pytest.raises(DeviceDropped, match=DROPPED):
            relay(state, spec, 2, node)
        killed.join()
    finally:
        server.shutdown()
        server.server_close()


def _take_and_vanish(url: str, token: str) -> None:
    """A phone that registers, takes the next task and is then killed (never answers)."""
    call(f"{url}/v1/register", "POST", token, b"")
    while call(f"{url}/v1/task", "GET", token)[0] != 200:
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.device
def test_gpt2_slice_exports_and_trains_as_torch(tmp_path):
    """GPT-2 (tied lm_head): the program keeps one embedding whose gradient sums both uses, as torch does. Dropout
    off: the program draws its own masks, so with dropout no two runs (torch's included) agree step by step."""
    from transformers import GPT2Config

    from fedfusion.models.build import config_aliases, model_from_state, wire_state
    from fedfusion.models.families import family_of
    from fedfusion.models.slicing import extract, plan_slice, sub_config
    from fedfusion.phone.program import export_program
    from fedfusion.phone.runtime import ProgramRunner, train_program
    from fedfusion.train.loop import train_steps

    target_config = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=32,
                               bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    target = family_of(target_config).build(target_config)
    plan = plan_slice(target_config, 0.5, "static")
    config = sub_config(target_config, plan)
    state = wire_state(extract(target.state_dict(), target_config, plan), config_aliases(config))
    runner = ProgramRunner(export_program(config, 2, 8))
    assert set(runner.params) == set(state)  # lm_head.weight travels as its alias, not twice
    runner.load(state)
    windows = torch.randint(0, 50, (20, 9), generator=torch.Generator().manual_seed(1))
    with runtime_steps(runner) as mine:
        stats = train_program(runner, windows, 4, 1e-2, 2, seed=3)
    model = model_from_state(config, state)
    with optimizer_steps(dict(model.named_parameters())) as theirs:
        result = train_steps(model, windows, 4, 1e-2, 2, seed=3)
    assert stats.tokens == result.tokens
    exact, drawn = ExactLM(config, state), batches(windows, 4, 2, 3)
    assert_steps(exact, mine, stats.losses, drawn)  # the tied embedding's gradient: both uses, within its bound
    assert_steps(exact, theirs, result.losses, drawn)
    assert_replayed(state, mine, runner.params, "adamw", 1e-2)


@pytest.mark.slow
@pytest.mark.device
def test_unexportable_family_names_family_and_op():
    """The CNN's GroupNorm views a parameter, which ExecuTorch cannot emit with external weights: a clear error."""
    from fedfusion.models.cnn import FedCNNConfig
    from fedfusion.phone.program import DeviceExportError, export_program

    with pytest.raises(DeviceExportError, match=r"^cnn model: .*operator \S+view"):
        export_program(FedCNNConfig(channels=[8, 16], groups=4, image_size=8), 2, 0)


@pytest.mark.slow
def test_a_gateway_dropout_is_a_dropped_row_with_its_work():
    """The error reply of a node whose phone missed the deadline is recorded as ``dropped`` (priced as wasted
    work, like a simulated dropout), not ``failed``; a device's own energy reading is kept with source 'device'."""
    from fedfusion.clients.device import DEVICE_METER_KEY
    from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedfusion.devices.catalog import load_catalog
    from fedfusion.run.federation import price_client
    from fedfusion.wire.specs import DROPPED
    from tests.test_strategy import FakeGrid, make_strategy

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as tests/test_strategy.py does
    strategy, state = make_strategy()
    msgs = {m.metadata.dst_node_id: m for m in
            strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), FakeGrid({11: "phone", 12: "phone"}))}
    trained = msgs[11].content["arrays"].to_torch_state_dict()
    metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": 0.1,
                            DEVICE_METER_KEY: 42.0})
    replies = [Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msgs[11]),
               Message(Error(code=1, reason=f"DeviceDropped: {DROPPED} device phone-a took the task and sent no "
                                            "result before its deadline"), reply_to=msgs[12])]
    strategy.aggregate_train(1, replies)
    ok, dropped = strategy.run.round.rows[11], strategy.run.round.rows[12]
    assert (ok.status, ok.measured_j, ok.measured_source) == ("ok", 42.0, "device")
    assert dropped.status == "dropped" and "phone-a" in dropped.error
    priced = price_client(dropped, load_catalog())
    assert priced["wasted"] and priced["energy_j"] > 0  # its planned work and download were spent for nothing


@pytest.mark.parametrize("overrides,message", [
    (["lora.method=flora"], r"^lora.method=flora: each round sends a frozen merged update"),
    (["lora.dropout=0.1"], r"^lora.dropout=0.1: a device program would draw its own dropout masks"),
    ([], r"^--tier 'watch': the recipe's lora.ranks has"),
])
def test_export_device_names_what_blocks_a_lora_tier(tmp_path, overrides, message):
    from fedfusion.config.recipe import load_recipe
    from fedfusion.phone.commands import check_tier

    recipe = load_recipe("rolling", ["fusion.method=lora", "data.source=chatterbot", f"lora.base={tmp_path}",
                                     *overrides])
    with pytest.raises(ValueError, match=message):
        check_tier(recipe, "phone" if overrides else "watch")
