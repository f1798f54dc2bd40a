"""Client-side differential privacy chosen per message: Flower's own mods, switched by the spec.

A ClientApp's mods are fixed when it is built, but the recipe decides privacy per run, so this one mod
reads ``dp-mode`` from the message's spec and hands over to Flower's ``fixedclipping_mod`` (clip the
update ``reply - received`` to ``clipping_norm``) or ``LocalDpMod`` (clip, then add Gaussian noise
calibrated to (epsilon, delta) with sensitivity = clipping_norm). Both compare the reply with the arrays
this client received, key by key, never with the full target: a sub-model's reply has its sub-model's
keys, a LoRA reply its whole starting adapter's. Arrays a client uses but never trains (FLoRA's frozen
``m.merged_*`` update) are hidden from that comparison and handed to the client untouched.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedfusion.lora import FROZEN_SUFFIXES


def privacy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Apply the recipe's ``privacy.mode`` (none | clip | local) to this train message's reply."""
    spec = msg.content["config"]
    mode = str(spec.get("dp-mode", "none"))
    if mode == "none":
        return call_next(msg, context)
    if mode not in ("clip", "local"):
        raise ValueError(f"dp-mode {mode!r}: expected none, clip or local")
    arrays = msg.content["arrays"]
    frozen = [k for k in arrays if k.endswith(FROZEN_SUFFIXES)]
    if frozen:  # Flower's mod sees (and clips against) the trained arrays only; the client gets them all
        msg.content["arrays"] = ArrayRecord({k: arrays[k] for k in arrays if k not in frozen})
        inner = call_next

        def call_next(m: Message, c: Context) -> Message:
            m.content["arrays"] = arrays
            return inner(m, c)

    if mode == "clip":
        return fixedclipping_mod(msg, context, call_next)
    norm = float(spec[KEY_CLIPPING_NORM])
    dp = LocalDpMod(clipping_norm=norm, sensitivity=norm, epsilon=float(spec["dp-epsilon"]),
                    delta=float(spec["dp-delta"]))
    return dp(msg, context, call_next)
