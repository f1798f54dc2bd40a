"""DP-SGD on the devices (``privacy.mode=dp_sgd``): the private step, its accounting and the recipe's checks."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from conftest import tiny_config
from fp_bounds import assert_within, gamma
from transformers import LlamaForCausalLM

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.run.check import load_checked
from fedfusion.train.dp import ClientBudgets, DpSgd, epsilon_spent, private_gradients
from fedfusion.train.loop import train_steps
from tests.ray_actors import ONE_ACTOR


def _lm(dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).to(dtype)


def test_the_private_gradient_is_the_mean_of_the_clipped_example_gradients_plus_the_stated_noise():
    """Two examples of a linear loss with known gradients (norms 5 and 0.5) clipped at 1: (3/5, 4/5) and the
    second as it is, summed, plus noise of sd noise_multiplier x clip drawn from the given generator, over 2."""
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    xs = [torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([0.3, 0.4], dtype=torch.float64)]
    dp = DpSgd(clip=1.0, noise_multiplier=0.5)
    per_example = [torch.autograd.grad((w * x).sum(), [w])[0] for x in xs]
    chunks = [[torch.stack(per_example)]]  # one chunk holding both examples' gradients
    got = private_gradients([w], chunks, 2, dp, torch.Generator().manual_seed(3))[0]
    noise = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float32).double() * 0.5
    want = (torch.tensor([0.6, 0.8], dtype=torch.float64) + xs[1] + noise) / 2
    # the clip divides by norm + 1e-12 (a guard for a zero gradient): relative 1e-12 / 5 on values below 1
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_example", ["vmap", "loop"])
def test_a_private_step_with_a_loose_clip_and_no_noise_to_speak_of_is_the_plain_sgd_step(per_example, monkeypatch):
    """float64: with every example's gradient under the clip and noise of sd 1e-20, a DP-SGD step (the examples'
    gradients vmapped, or one example's backward at a time) moves the model as the plain batched SGD step does: the
    batch's mean loss is the mean of its examples' (every window has the same token count).

    Both loops report the first step's loss from one forward on equal inputs (the same model, the same batch): equal,
    bit for bit. The steps are checked one by one (model_bounds: no rounding bound of a trajectory is less than its
    steps): at every step each loop's gradient, at the values that loop held then, is within
    :class:`model_bounds.ExactLM`'s bound of the exact mean gradient on that step's batch, float32's (the next-token
    loss takes its cross-entropy in float32, HF's RMSNorm computes in float32; the float64 products round less),
    the private one with two roundings more (the examples' sum, the noise's add; the scale 1 of an unclipped example
    and the divisions by the batch's and the windows' powers of two are exact) and its noise: ``|z| < 9`` for torch's
    CPU ``randn`` (Box-Muller on uniforms of at most 53 bits: ``sqrt(-2 ln 2^-53) < 8.6``), so ``9 x 1e-20 / 4``.
    Each loop stepped by what it computed (SGD replayed from the start, bit for bit). A private step that left the
    mean (a sum, a clipped or a noisy gradient) would be off by a share of the gradient itself: the bound is below
    1e-3 of it (a gradient 1e-3 too large is caught)."""
    from model_bounds import ExactLM, assert_steps, batches, optimizer_steps

    from fedfusion.train import loop

    monkeypatch.setattr(loop, "_LOOPED", {(LlamaForCausalLM, type(loop.LM))} if per_example == "loop" else set())
    data = torch.randint(0, 50, (16, 9), generator=torch.Generator().manual_seed(1))
    plain, private = _lm(), _lm()
    dp = DpSgd(clip=1e6, noise_multiplier=1e-26)
    with optimizer_steps(dict(plain.named_parameters())) as plain_steps:
        a = train_steps(plain, data, steps=2, lr=0.1, batch_size=4, seed=5, optimizer="sgd")
    with optimizer_steps(dict(private.named_parameters())) as private_steps:
        b = train_steps(private, data, steps=2, lr=0.1, batch_size=4, seed=5, optimizer="sgd", dp=dp)
    assert a.tokens == b.tokens and a.losses[0] == b.losses[0]
    assert all(torch.equal(v, private_steps[0][0][k]) for k, v in plain_steps[0][0].items())  # one start
    start = {k: v.detach().clone() for k, v in _lm().named_parameters()}
    drawn = batches(data, 2, 4, 5)
    assert assert_steps(ExactLM(None, {}, model=_lm(), trained={k: k for k in start}), plain_steps, a.losses, drawn) <= 1
    noise = 9 * dp.noise_multiplier * dp.clip / 4
    private_exact = ExactLM(None, {}, model=_lm(), trained={k: k for k in start}, roundings=2)
    plus_noise = _PlusNoise(private_exact, noise)
    assert assert_steps(plus_noise, private_steps, b.losses, drawn) <= 1
    with pytest.raises(AssertionError):  # the bound is tight enough to matter
        assert_steps(plus_noise, [(v, {k: g * (1 + 1e-3) for k, g in grads.items()}) for v, grads in private_steps],
                     b.losses, drawn)
    for model, steps in ((plain, plain_steps), (private, private_steps)):
        replay = {k: v.clone().requires_grad_(True) for k, v in start.items()}
        sgd = torch.optim.SGD(replay.values(), lr=0.1)
        for values, grads in steps:
            assert all(torch.equal(replay[k].detach(), v) for k, v in values.items())
            for k, p in replay.items():
                p.grad = grads[k]
            sgd.step()
        assert all(torch.equal(replay[k].detach(), p.detach()) for k, p in model.named_parameters())
        assert any(not torch.equal(start[k], p.detach()) for k, p in model.named_parameters())  # it moved


class _PlusNoise:
    """An :class:`model_bounds.ExactLM` whose gradient bounds also hold ``noise`` (the largest DP noise a private
    gradient's entry carries)."""

    def __init__(self, exact, noise: float) -> None:
        self.exact, self.noise = exact, noise

    def at(self, theta, batch):
        want = self.exact.at(theta, batch)
        want.grad_bounds = {k: v + self.noise for k, v in want.grad_bounds.items()}
        return want


def test_a_tight_clip_bounds_what_one_private_step_can_move():
    """Each example's gradient clipped to 1e-3 in L2 over all tensors: one SGD step of lr 1 moves the parameters by
    at most the clip (their mean) plus the noise (sd 1e-9 x 1e-3 per coordinate, negligible in float64)."""
    model = _lm()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    data = torch.randint(0, 50, (8, 9), generator=torch.Generator().manual_seed(2))
    train_steps(model, data, steps=1, lr=1.0, batch_size=4, seed=0, optimizer="sgd", dp=DpSgd(1e-3, 1e-9))
    moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    assert 0 < float(moved.norm()) <= 1e-3 * (1 + 1e-6)


def test_the_noise_is_not_the_rounds_seed():
    """The same seed, data and model twice: the private steps differ (the noise comes from the OS, which the
    server cannot reproduce), the plain ones do not."""
    data = torch.randint(0, 50, (8, 9), generator=torch.Generator().manual_seed(2))
    runs = []
    for dp in (None, None, DpSgd(1.0, 1.0), DpSgd(1.0, 1.0)):
        model = _lm(torch.float32)
        train_steps(model, data, steps=1, lr=0.1, batch_size=4, seed=0, dp=dp)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[2], runs[3])


def test_epsilon_grows_with_steps_and_sampling_and_shrinks_with_noise():
    assert epsilon_spent([], 1e-5) == 0.0
    base = epsilon_spent([(1.0, 0.05, 100)], 1e-5)
    assert 0 < base < epsilon_spent([(1.0, 0.05, 200)], 1e-5)
    assert base < epsilon_spent([(1.0, 0.1, 100)], 1e-5)
    assert epsilon_spent([(2.0, 0.05, 100)], 1e-5) < base
    # two rounds recorded apart are the same history as one of their steps together
    assert epsilon_spent([(1.0, 0.05, 100), (1.0, 0.05, 100)], 1e-5) == pytest.approx(
        epsilon_spent([(1.0, 0.05, 200)], 1e-5), rel=1e-9)


def test_client_budgets_account_each_partition_apart_and_say_what_a_round_would_cost():
    budgets = ClientBudgets(noise_multiplier=1.0, delta=1e-5, epsilon=3.0, history={})
    ahead = budgets.after(0, examples=40, batch_size=4, steps=8)
    assert budgets.spent(0) == 0.0 and ahead > 0
    assert budgets.spend(0, examples=40, batch_size=4, steps=8) == pytest.approx(ahead)
    assert budgets.spent(1) == 0.0  # another client's history is its own
    assert budgets.history[0] == [(1.0, 0.1, 8)]
    assert budgets.spend(1, examples=2, batch_size=4, steps=1) == pytest.approx(epsilon_spent([(1.0, 1.0, 1)], 1e-5))


@pytest.mark.slow  # two noise calibrations (Opacus' search over its accountant): ~2.6 s
def test_auto_noise_spends_each_clients_budget_over_its_expected_rounds_and_no_more():
    """noise_multiplier 0: each client's noise is the smallest whose expected rounds fit the budget (to Opacus'
    search tolerance, 0.01 in epsilon), so the last of them lands just under it and one more would pass it; a client
    with more examples (a lower sampling rate) gets less noise for the same budget."""
    budgets = ClientBudgets(noise_multiplier=0.0, delta=1e-5, epsilon=4.0, history={}, rounds=3)
    for _ in range(3):
        spent = budgets.spend(0, examples=48, batch_size=16, steps=10)
    assert 4.0 - 0.01 <= spent <= 4.0
    assert budgets.after(0, examples=48, batch_size=16, steps=10) > 4.0
    assert budgets.sigma(480, 16, 10) < budgets.sigma(48, 16, 10)
    assert budgets.history[0][0][0] == budgets.sigma(48, 16, 10) > 0
    with pytest.raises(ValueError, match="rounds each client's budget"):
        ClientBudgets(noise_multiplier=0.0, delta=1e-5, epsilon=4.0, history={}).sigma(48, 16, 10)


def test_dp_sgd_settings_are_checked_with_the_key_named():
    recipe = load_checked("quickstart", ["privacy.mode=dp_sgd", "privacy.noise_multiplier=0.8"])
    assert recipe.privacy.noise_multiplier == 0.8
    with pytest.raises(RecipeError, match="privacy.noise_multiplier"):
        load_checked("quickstart", ["privacy.mode=dp_sgd", "privacy.noise_multiplier=-1"])
    with pytest.raises(RecipeError, match="privacy.epsilon"):
        load_checked("quickstart", ["privacy.mode=dp_sgd", "privacy.epsilon=-1"])


def test_generative_takes_dp_sgd_and_refuses_the_reply_mods_with_a_reason():
    with pytest.raises(RecipeError, match="generative client replies samples; use privacy.mode=dp_sgd"):
        load_recipe("knowledge", ["privacy.mode=local"])
    assert load_recipe("knowledge", ["privacy.mode=dp_sgd"]).privacy.mode == "dp_sgd"


def test_private_samples_open_with_random_tokens_not_the_clients_own():
    from fedfusion.fusion.generative.reply import sample_windows

    model = _lm(torch.float32)
    own = torch.full((4, 9), 7)
    plain = sample_windows(model, own, 16, 1.0, seed=0)
    private = sample_windows(model, own, 16, 1.0, seed=0, private=True)
    assert plain.shape == private.shape == (16, 9)
    assert (plain[:, 0] == 7).all() and len(set(private[:, 0].tolist())) > 1


@pytest.mark.slow  # Flower's simulation engine
def test_a_dp_sgd_run_accounts_every_clients_epsilon_and_keeps_each_within_the_budget(tmp_path):
    """The quickstart with DP-SGD and a budget (4) that one round of the clients with the fewest windows already
    passes (their sampling rate batch / windows is the highest): every trained row carries its client's epsilon,
    recomputed here from the ledger's history of that client, none over the budget; a client whose first round
    would pass it never trains; the report states the mechanism and what was spent."""
    import json

    from omegaconf import OmegaConf

    from fedfusion.cli import main

    out = tmp_path / "run"
    assert main(["run", "quickstart", "privacy.mode=dp_sgd", "privacy.epsilon=4", "rounds=3",
                 "population.num_clients=4", "selection.clients_per_round=2", "train.local_steps=2",
                 ONE_ACTOR, "--out", str(out)]) == 0  # the accounting is the server's; nodes keep nothing
    rows = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(0 < r["epsilon"] <= 4 and r["delta"] == 1e-5 for r in ok)
    history: dict[int, list] = {}
    batch = OmegaConf.load(out / "recipe.yaml").train.batch_size
    for r in ok:  # a batch of the client's windows, 2 steps a round, noise multiplier 1
        history.setdefault(r["partition"], []).append((1.0, min(1.0, batch / r["examples"]), 2))
        assert r["epsilon"] == pytest.approx(epsilon_spent(history[r["partition"]], 1e-5), rel=1e-9)
    assert len({r["partition"] for r in ok}) < 4  # some client never trained: one round passes its budget
    assert "Privacy: DP-SGD on every device" in (out / "report.md").read_text()


def test_the_strategy_keeps_each_clients_dp_history_in_its_checkpoint_state():
    """A resumed run continues each client's accounting: the history goes into the strategy's state and back."""
    from fedfusion.strategies import FusionStrategy
    from test_strategy import make_strategy, new_strategy

    from fedfusion.devices.catalog import load_catalog
    from fedfusion.run.federation import privacy_spec
    from fedfusion.selection.participation import Participation
    from fedfusion.selection.selectors import make_selector

    plain, _ = make_strategy()
    assert plain.run.budgets is None  # no dp_sgd in its spec: nothing accounted
    dp = privacy_spec(load_recipe("quickstart", ["privacy.mode=dp_sgd", "privacy.noise_multiplier=0.7"]))

    def private() -> FusionStrategy:
        return new_strategy(plain.run.methods, clients_per_round=3, query_config={"population": "{}"},
                              participation=Participation(make_selector("random", seed=0), load_catalog()),
                              train_config={**plain.settings.train_config, **dp}, wait_nodes_s=1.0)

    first = private()
    assert first.run.budgets is not None and first.run.budgets.noise_multiplier == 0.7
    spent = first.run.budgets.spend(3, examples=40, batch_size=4, steps=8)
    second = private()
    second.run.load_state_dict(first.run.state_dict(), rounds_done=1)
    assert second.run.budgets is not None and second.run.budgets.history == {3: [(0.7, 0.1, 8)]}
    assert second.run.budgets.spent(3) == spent


@pytest.mark.parametrize("window", ["core", "low_rank", "float32", "expanded"])
def test_a_vmapped_private_step_on_a_frozen_target_window_moves_it_as_the_looped_one(window, monkeypatch):
    """A full-forward window (its trainable tensors read through fedfusion.models.frozen.Slot, so torch.func's
    functional_call reaches the frozen layers) takes the vmapped path and moves as one example's backward at a time
    does (expanded: the frozen target made float32 once, each vmapped example writing into its own copy). float32
    (the frozen target is, or is made): each gradient entry sums at most batch x positions x hidden products in
    another order, so the two differ by at most 2 gamma_n times their magnitudes, taken here as the step's largest
    move; a window whose layers missed the swap would lose whole gradients, far beyond it."""
    from fedfusion.fusion.base import Client
    from fedfusion.fusion.submodel.method import SubModelMethod
    from fedfusion.models.families import family_of
    from fedfusion.models.full_forward import from_payload
    from fedfusion.train import loop
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.quantize import decode
    from fedfusion.wire.specs import WindowSpec

    cfg = tiny_config()
    torch.manual_seed(0)
    state = family_of(cfg).build(cfg).state_dict()
    kind = {"core": {"window_core": True}, "low_rank": {"window_rank": 2}, "float32": {},
            "expanded": {"expand": frozenset({"t"})}}[window]
    method = SubModelMethod(cfg, {"t": 0.25}, state, forward="full", frozen="float32" if window == "float32" else "int8",
                            scale=False, stagger=False, window_shared=True, **kind)
    payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=3)])[0]
    spec = WindowSpec.from_config(WindowSpec.from_config(payload.spec).to_config())
    start = from_payload(cfg, decode(payload.arrays, keep=FROZEN), spec, 3)
    data = torch.randint(0, cfg.vocab_size, (16, 9), generator=torch.Generator().manual_seed(1))
    moved = {}
    for path in ("vmap", "loop"):
        model = copy.deepcopy(start)
        key = (type(model), type(loop.loss_of(model)))
        monkeypatch.setattr(loop, "_LOOPED", {key} if path == "loop" else set())
        assert loop._vmappable(model, loop.loss_of(model)) == (path == "vmap")
        train_steps(model, data, steps=1, lr=0.5, batch_size=8, seed=5, optimizer="sgd", loss=loop.loss_of(model),
                    dp=DpSgd(clip=1e6, noise_multiplier=1e-30))
        assert loop._LOOPED == ({key} if path == "loop" else set())  # the vmapped path did not fall back
        moved[path] = [p.detach() - q.detach() for p, q in zip(model.parameters(), start.parameters())]
    largest = max(float(m.abs().max()) for m in moved["loop"])
    bound = 2 * gamma(8 * 8 * cfg.hidden_size, torch.float32) * largest
    assert largest > 0
    for a, b in zip(moved["vmap"], moved["loop"]):
        assert_within(a, b, bound)


@pytest.mark.slow  # a fresh interpreter
def test_accounting_leaves_the_root_logger_as_it_was_so_flower_lines_print_once():
    """Importing Opacus calls logging.basicConfig; the accountant is imported without keeping that handler, so a
    Flower log line (which propagates to the root) is printed once, not twice."""
    code = ("import logging; from fedfusion.train.dp import epsilon_spent; epsilon_spent([(1.0, 0.1, 10)], 1e-5); "
            "from flwr.common.logger import log; log(logging.WARNING, 'the-line'); "
            "import opacus; print(len(logging.getLogger().handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "0" and out.stderr.count("the-line") == 1

