"""A client's side of secure aggregation (``privacy.secure_aggregation``; the arithmetic is
:mod:`fedfusion.wire.secagg`): fresh keys, shares of its secrets for the others, its update masked, and at the end
the shares the server may have.

The round's steps arrive as QUERY messages (``query.secagg``: keys, shares, unmask) around the TRAIN message; what a
node must remember between them (its secrets, the others' public keys, the sealed shares it holds) stays in
Flower's ``context.state``, which persists per node. :func:`secagg_mod` wraps training: it takes the trained
arrays off the reply and puts the masked target-shaped change in their place (for a LoRA method that averages
dense updates, the change of each module's dense update), so the server never holds the client's update itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.crypto.shamir import create_shares

from fedfusion.wire import secagg as sa
from fedfusion.wire.keys import FROZEN, NUM_EXAMPLES
from fedfusion.wire.quantize import Index, decode, unpack_index
from fedfusion.wire.specs import SecAggSpec

STATE = "secagg-state"  # context.state's record of this node's round of secure aggregation


def _bytes(record: ArrayRecord, key: str) -> bytes:
    return cast(np.ndarray, record[key].numpy()).tobytes()


def _array(data: bytes) -> Array:
    return Array(np.frombuffer(data, dtype=np.uint8).copy())


def _state(context: Context, spec: SecAggSpec) -> ConfigRecord:
    """This node's record for ``spec``'s round; ValueError if it holds none (it restarted, or missed a step)."""
    state = context.state.config_records.get(STATE)
    if state is None or int(cast(int, state["round"])) != spec.round:
        raise ValueError(f"secure aggregation: this node holds no keys for round {spec.round} (restarted?)")
    return state


def _keys(spec: SecAggSpec, own: int, context: Context) -> ArrayRecord:
    """Step 1: two fresh key pairs (for sealing shares, for masks) and a self-mask seed; the public keys go up."""
    c_secret, c_public = sa.new_keys()
    s_secret, s_public = sa.new_keys()
    context.state.config_records[STATE] = ConfigRecord({
        "round": spec.round, "own": own, "c-secret": c_secret, "s-secret": s_secret, "seed": sa.new_seed()})
    return ArrayRecord({sa.C_PUBLIC + str(own): _array(c_public), sa.S_PUBLIC + str(own): _array(s_public)})


def _shares(spec: SecAggSpec, own: int, arrays: ArrayRecord, context: Context) -> ArrayRecord:
    """Step 2: Shamir shares of the mask secret and the seed, one pair for every position that sent keys, each
    sealed for its holder; this node's own pair stays here."""
    state = _state(context, spec)
    if len(spec.peers) < spec.threshold or own not in spec.peers:
        raise ValueError(f"secure aggregation: {len(spec.peers)} clients hold keys, fewer than the threshold "
                         f"{spec.threshold} or without this node")
    n = len(spec.nodes)
    c_public = {p: _bytes(arrays, sa.C_PUBLIC + str(p)) for p in spec.peers}
    s_public = {p: _bytes(arrays, sa.S_PUBLIC + str(p)) for p in spec.peers}
    mask_shares = create_shares(cast(bytes, state["s-secret"]), spec.threshold, n)
    seed_shares = create_shares(cast(bytes, state["seed"]), spec.threshold, n)
    out = {}
    for p in spec.peers:
        if p != own:
            key = sa.fernet_key(cast(bytes, state["c-secret"]), c_public[p])
            out[sa.SEALED + str(p)] = _array(sa.seal(key, own, p, mask_shares[p], seed_shares[p]))
    state["mask-share"], state["seed-share"] = mask_shares[own], seed_shares[own]
    state["c-public"] = [c_public.get(p, b"") for p in range(n)]
    state["s-public"] = [s_public.get(p, b"") for p in range(n)]
    return ArrayRecord(out)


def _unmask(spec: SecAggSpec, own: int, context: Context) -> ArrayRecord:
    """Step 4: for each survivor the share of its seed, for each dropped client the share of its mask secret;
    never both for one client (that would unmask its vector), and only for clients this node masked with."""
    state = _state(context, spec)
    masked_with = set(cast(list[int], state.get("peers", [])))
    survivors, dropped = set(spec.peers), set(spec.dropped)
    if not masked_with:
        raise ValueError("secure aggregation: asked to unmask before this node masked its update")
    if survivors & dropped or not (survivors | dropped) <= masked_with or own not in survivors:
        raise ValueError("secure aggregation: refused to unmask: the survivors and the dropped overlap, or are not "
                         "the clients this node masked with")
    if len(survivors) < spec.threshold:
        raise ValueError(f"secure aggregation: {len(survivors)} survivors, fewer than the threshold {spec.threshold}")
    sealed = cast(list[bytes], state["sealed"])
    c_public = cast(list[bytes], state["c-public"])
    out = {}
    for p in sorted(survivors | dropped):
        if p == own:
            mask_share, seed_share = cast(bytes, state["mask-share"]), cast(bytes, state["seed-share"])
        else:
            key = sa.fernet_key(cast(bytes, state["c-secret"]), c_public[p])
            mask_share, seed_share = sa.open_sealed(key, sealed[p], p, own)
        out[sa.SHARE + str(p)] = _array(seed_share if p in survivors else mask_share)
    del context.state.config_records[STATE]  # the round is over for this node: nothing more is revealed
    return ArrayRecord(out)


def query(msg: Message, context: Context) -> Message:
    """A secure-aggregation step (keys, shares or unmask) as the message's :class:`SecAggSpec` says."""
    spec = SecAggSpec.from_config(msg.content.config_records["config"])
    own = spec.position(msg.metadata.dst_node_id)
    if spec.stage == "keys":
        arrays = _keys(spec, own, context)
    elif spec.stage == "shares":
        arrays = _shares(spec, own, msg.content.array_records["arrays"], context)
    elif spec.stage == "unmask":
        arrays = _unmask(spec, own, context)
    else:
        raise ValueError(f"secure aggregation: stage {spec.stage!r} does not come as a query")
    return Message(RecordDict({"arrays": arrays}), reply_to=msg)


def padded(update: Mapping[str, torch.Tensor], index: Mapping[str, Index], scales: Mapping[str, float],
           shapes: Sequence[tuple[int, ...]], weight: float) -> np.ndarray:
    """``weight`` x ``update`` (each array divided by its scale) written where ``index`` puts it in a target of
    ``shapes``, zeros elsewhere, flattened in order (float64)."""
    from fedfusion.models.slicing import scatter  # not at the top: slicing imports transformers (seconds of every
    # ClientApp process's start, a deployed node's per message), which the units role never loads

    if set(update) != set(index):
        raise ValueError(f"secure aggregation: the update's arrays {sorted(update)[:3]} are not the ones the server "
                         f"indexed {sorted(index)[:3]}")
    tensors = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
    for name, (tid, dims) in index.items():
        scatter(tensors[tid], dims, update[name].double() * (weight / scales[name]), accumulate=True)
    return torch.cat([t.flatten() for t in tensors]).numpy() if tensors else np.zeros(0)


def _layout(arrays: dict[str, torch.Tensor], names: list[str]) -> tuple[dict[str, Any], dict[str, float],
                                                                      list[tuple[int, ...]]]:
    """The target coordinates (index), scales and target shapes the server sent with the trained arrays ``names``."""
    index = unpack_index(arrays[sa.INDEX_KEY], names)
    scales = dict(zip(sorted(names), arrays[sa.SCALES_KEY].tolist()))
    return index, scales, sa.unpack_shapes(arrays[sa.SHAPES_KEY])


def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Train, then reply the masked target-shaped change, cut to the round's support
    (:data:`fedfusion.wire.secagg.MASKED_KEY`), instead of the trained arrays; a message without a
    secure-aggregation spec passes as it is."""
    config = msg.content.config_records["config"]
    spec = SecAggSpec.from_config_if_any(config)
    if spec is None:
        return call_next(msg, context)
    state = _state(context, spec)
    own = spec.position(msg.metadata.dst_node_id)
    record = msg.content.array_records["arrays"]
    layout = {k: torch.from_numpy(record[k].numpy()) for k in (*sa.ARRAY_KEYS, sa.PRODUCT_KEY) if k in record}
    sealed = {int(k.removeprefix(sa.SEALED)): _bytes(record, k) for k in record if k.startswith(sa.SEALED)}
    plain = ArrayRecord({k: record[k] for k in record if k not in layout and not k.startswith(sa.SEALED)})
    msg.content["arrays"] = plain
    received = {k: v for k, v in decode(plain.to_torch_state_dict(), keep=FROZEN).items() if not k.startswith(FROZEN)}
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    trained = reply.content.array_records["arrays"].to_torch_state_dict()
    metrics = reply.content.metric_records["metrics"]
    if sa.PRODUCT_KEY in layout:  # a dense LoRA method: the change of each module's dense update
        change = sa.dense_change(received, trained, float(layout[sa.PRODUCT_KEY]))
    else:
        change = {k: trained[k].float() - received[k] for k in trained}
    index, scales, shapes = _layout(layout, list(change))
    weight = float(cast(int, metrics[NUM_EXAMPLES])) if spec.weighting == "examples" else 1.0
    support = sa.unpack_support(layout[sa.SUPPORT_KEY])
    vector = sa.encode(padded(change, index, scales, shapes, weight)[support])
    s_public = cast(list[bytes], state["s-public"])
    peers = {p: s_public[p] for p in spec.peers}
    masked = sa.masked(vector, own, cast(bytes, state["seed"]), cast(bytes, state["s-secret"]), peers)
    state["peers"] = list(spec.peers)
    state["sealed"] = [sealed.get(p, b"") for p in range(len(spec.nodes))]
    return Message(RecordDict({"arrays": ArrayRecord({sa.MASKED_KEY: Array(masked)}), "metrics": metrics}),
                   reply_to=msg)
