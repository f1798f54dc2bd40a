"""Client-side differential privacy chosen per message: Flower's own mods, switched by the spec.

A ClientApp's mods are fixed when it is built, but the recipe decides privacy per run, so this one mod
reads ``dp-mode`` from the message's spec and hands over to Flower's ``fixedclipping_mod`` (clip the
update ``reply - received`` to ``clipping_norm``) or ``LocalDpMod`` (clip, then add Gaussian noise
calibrated to (epsilon, delta) with sensitivity = clipping_norm). Both work on any sub-model or adapter
because they compare the reply with the arrays this client received, never with the full target.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM


def privacy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Apply the recipe's ``privacy.mode`` (none | clip | local) to this train message's reply."""
    spec = msg.content["config"]
    mode = str(spec.get("dp-mode", "none"))
    if mode == "clip":
        return fixedclipping_mod(msg, context, call_next)
    if mode == "local":
        norm = float(spec[KEY_CLIPPING_NORM])
        dp = LocalDpMod(clipping_norm=norm, sensitivity=norm, epsilon=float(spec["dp-epsilon"]),
                        delta=float(spec["dp-delta"]))
        return dp(msg, context, call_next)
    if mode != "none":
        raise ValueError(f"dp-mode {mode!r}: expected none, clip or local")
    return call_next(msg, context)
