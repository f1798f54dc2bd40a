"""Client-side DP through Flower's own mods, switched per message by the recipe's privacy spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedfusion.clients.privacy import privacy_mod
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from fp_bounds import gamma, unit_roundoff

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.models.build import model_from_state
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.run.federation import privacy_spec
from tests.conftest import tiny_config
from tests.test_strategy import task_identity  # noqa: F401 (autouse fixture)


def _train_message(spec: dict) -> tuple[Message, dict[str, torch.Tensor]]:
    """A TRAIN message carrying a real half-width sub-model, as FusionStrategy builds it for a sub-model client."""
    cfg = tiny_config()
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    plan = plan_slice(cfg, 0.5, "rolling", 2)
    sent = extract(LlamaForCausalLM(cfg).state_dict(), cfg, plan)
    # the client rebuilds the sub-model with transformers and replies its state_dict: the key order must match
    model = model_from_state(sub_config(cfg, plan), sent)
    content = RecordDict({"arrays": ArrayRecord(sent), "config": ConfigRecord(spec)})
    msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    return msg, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(spec: dict, shift: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    msg, state = _train_message(spec)

    def client(m: Message, ctx: Context) -> Message:
        trained = {k: v + shift for k, v in state.items()}
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=m)

    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    reply = privacy_mod(msg, ctx, client)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    sent = {k: v.numpy() for k, v in msg.content["arrays"].to_torch_state_dict().items()}
    return sent, {k: v.numpy() for k, v in reply.content["arrays"].to_torch_state_dict().items()}


def _update_norm(sent: dict, got: dict) -> float:
    """The norm of got - sent, in float64 (exact differences of float32 values, and no rounding of note)."""
    return float(np.sqrt(sum(((got[k].astype(np.float64) - sent[k]) ** 2).sum() for k in sent)))


def test_clip_mode_bounds_the_update_norm_of_a_sub_model():
    spec = privacy_spec(load_recipe("quickstart", ["privacy.mode=clip", "privacy.clipping_norm=0.5"]))
    sent, got = _run(spec, shift=1.0)
    # the clip in float32: the change (one rounding each), its squared norm over n numbers (gamma_n, halved by the
    # root), the root, the factor, the product (gamma_5 more), and each clipped value's own rounding (u |got|)
    n = sum(v.size for v in sent.values())
    size = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in got.values())))
    bound = 0.5 * gamma(n // 2 + 6, torch.float32) + unit_roundoff(torch.float32) * size
    assert abs(_update_norm(sent, got) - 0.5) <= bound
    small_sent, small_got = _run(spec, shift=1e-4)  # already inside the bound: untouched
    assert _update_norm(small_sent, small_got) < 0.5
    # the client's own sent + 1e-4 (one IEEE float32 addition, the same on every machine), passed through untouched
    assert all(np.array_equal(small_got[k], small_sent[k] + np.float32(1e-4)) for k in small_sent)


def test_local_mode_clips_then_adds_noise():
    spec = privacy_spec(load_recipe("quickstart", ["privacy.mode=local", "privacy.clipping_norm=0.5",
                                                   "privacy.epsilon=1.0"]))
    sent, got = _run(spec, shift=1.0)
    assert _update_norm(sent, got) > 0.5 * 2  # Gaussian noise at sigma ~ 2.4 per coordinate dominates


def test_no_privacy_passes_the_reply_through():
    sent, got = _run(privacy_spec(load_recipe("quickstart")), shift=0.25)
    assert all(np.array_equal(got[k], sent[k] + np.float32(0.25)) for k in sent)  # one IEEE addition, untouched


def test_privacy_recipe_values_are_checked():
    with pytest.raises(RecipeError, match="privacy.mode"):
        load_recipe("quickstart", ["privacy.mode=secret"])
    with pytest.raises(RecipeError, match="privacy.clipping_norm"):
        load_recipe("quickstart", ["privacy.mode=clip", "privacy.clipping_norm=0"])
