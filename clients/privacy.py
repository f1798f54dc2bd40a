"""Client-side differential privacy chosen per message: Flower's own mods, switched by the spec.

A ClientApp's mods are fixed when it is built, but the recipe decides privacy per run, so this one mod
reads the message's :class:`~fedfusion.wire.specs.PrivacySpec` and hands over to Flower's ``fixedclipping_mod`` (clip the
update ``reply - received`` to ``clipping_norm``) or ``LocalDpMod`` (clip, then add Gaussian noise
calibrated to (epsilon, delta) with sensitivity = clipping_norm); ``dp_sgd`` is the training loop's own
(:mod:`fedfusion.train.dp`). Both compare the reply with the arrays
this client received, key by key, never with the full target: a sub-model's reply has its sub-model's
keys, a LoRA reply its whole starting adapter's. Arrays a client uses but never trains (FLoRA's frozen
``m.merged_*`` update) are hidden from that comparison and handed to the client untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable

from fedfusion.train.dp import DpSgd
from fedfusion.wire.keys import FROZEN_SUFFIXES
from fedfusion.wire.specs import PrivacySpec


def private_training(spec: Mapping[str, Any]) -> DpSgd | None:
    """The DP-SGD settings of the local loop when the message asks for ``privacy.mode=dp_sgd``, else None."""
    privacy = PrivacySpec.from_config_if_any(spec)
    if privacy is None or privacy.mode != "dp_sgd":
        return None
    return DpSgd(privacy.clipping_norm, privacy.noise_multiplier)


def privacy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Apply the recipe's ``privacy.mode`` (none | clip | local) to this train message's reply; dp_sgd works
    inside the training loop (:func:`private_training`), so its reply passes as it is."""
    privacy = PrivacySpec.from_config(msg.content["config"])  # its mode is one the recipe allows
    if privacy.mode in ("none", "dp_sgd"):
        return call_next(msg, context)
    arrays = msg.content["arrays"]
    frozen = [k for k in arrays if k.endswith(FROZEN_SUFFIXES)]
    if frozen:  # Flower's mod sees (and clips against) the trained arrays only; the client gets them all
        msg.content["arrays"] = ArrayRecord({k: arrays[k] for k in arrays if k not in frozen})
        inner = call_next

        def call_next(m: Message, c: Context) -> Message:
            m.content["arrays"] = arrays
            return inner(m, c)

    if privacy.mode == "clip":  # Flower's mod reads the clipping norm from the config itself
        return fixedclipping_mod(msg, context, call_next)
    norm = privacy.clipping_norm
    dp = LocalDpMod(clipping_norm=norm, sensitivity=norm, epsilon=privacy.epsilon, delta=privacy.delta)
    return dp(msg, context, call_next)
