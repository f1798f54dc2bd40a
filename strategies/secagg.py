"""The server's side of secure aggregation (``privacy.secure_aggregation``; the arithmetic is
:mod:`fedfusion.wire.secagg`, the client's side :mod:`fedfusion.clients.secagg`).

Around each training round: the sampled nodes send fresh public keys (``keys``), then Shamir shares of their
secrets sealed for each other, which the server routes without reading (``shares``); each TRAIN message carries the
shares sealed for its node; each reply is a masked target-shaped vector; at the end the nodes that replied send the
shares the protocol allows (``unmask``), and the server rebuilds the masks it may take off the sum. A node that fails
a step before training leaves the round (a ``failed`` row); one that fails after its shares went out is unmasked
from the others' shares. Fewer survivors than the threshold (a majority) leave nothing to unmask: the round is void.

Against whom: an honest-but-curious server (it follows the protocol and reads what it holds). Public keys are not
authenticated, so a server that lies about them can read updates; so can one that colludes with a threshold of
clients. The server learns the sum of the round's weighted changes and, as without it, who trained which slice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.serverapp import Grid

from fedfusion.wire import secagg as sa
from fedfusion.wire.specs import SECAGG_ACTION, SecAggSpec


def _bytes(record: ArrayRecord, key: str) -> bytes:
    return cast(np.ndarray, record[key].numpy()).tobytes()


@dataclass
class _Keys:
    """One round's state: its nodes in position order, the positions whose shares went out, their mask public keys,
    the shares sealed from one position for another, the bytes each node moved in the extra steps and the wall
    seconds they took (the clients' round trips included)."""

    round: int = 0
    nodes: list[int] = field(default_factory=list)
    threshold: int = 2
    sharing: list[int] = field(default_factory=list)
    s_public: dict[int, bytes] = field(default_factory=dict)
    sealed: dict[tuple[int, int], bytes] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


class SecureAggregation:
    """Runs the extra steps of secure aggregation on Flower's ``Grid``; ``weighting`` (``examples`` or ``uniform``)
    tells the clients whether to weight their change by their examples, as the fold would; ``timeout_s`` bounds
    each step."""

    def __init__(self, weighting: str = "uniform", timeout_s: float = 600.0) -> None:
        self.weighting, self.timeout_s = weighting, timeout_s
        self.keys = _Keys()

    def _spec(self, stage: str, peers: Sequence[int] = (), dropped: Sequence[int] = ()) -> SecAggSpec:
        k = self.keys
        return SecAggSpec(stage, k.round, tuple(str(n) for n in k.nodes), k.threshold, tuple(peers), tuple(dropped),
                          self.weighting)

    def _ask(self, grid: Grid, positions: Sequence[int], spec: SecAggSpec,
             arrays: dict[int, dict[str, bytes]] | None = None) -> dict[int, ArrayRecord]:
        """Send ``spec`` (and each position's ``arrays``) to ``positions``; their good replies by position."""
        k, start = self.keys, time.perf_counter()
        messages, position = [], {}
        for p in positions:
            node = k.nodes[p]
            record = ArrayRecord({key: Array(np.frombuffer(v, dtype=np.uint8).copy())
                                  for key, v in (arrays or {}).get(p, {}).items()})
            k.nbytes[node] = k.nbytes.get(node, 0) + record.count_bytes()
            messages.append(Message(RecordDict({"config": ConfigRecord(spec.to_config()), "arrays": record}),
                                    dst_node_id=node, message_type=f"{MessageType.QUERY}.{SECAGG_ACTION}"))
            position[node] = p
        out = {}
        for reply in grid.send_and_receive(messages, timeout=self.timeout_s):
            node = reply.metadata.src_node_id
            if node not in position:
                continue
            if reply.has_error():
                log(WARNING, "round %d node %d: secure aggregation (%s) failed: %s", k.round, node, spec.stage,
                    (reply.error.reason or "").strip().splitlines()[-1:] or "")
                continue
            record = cast(ArrayRecord, reply.content["arrays"])
            k.nbytes[node] = k.nbytes.get(node, 0) + record.count_bytes()
            out[position[node]] = record
        k.seconds += time.perf_counter() - start
        return out

    def setup(self, grid: Grid, nodes: Sequence[int], server_round: int) -> dict[int, str]:
        """Keys and shares among ``nodes`` before round ``server_round`` trains; returns the nodes that cannot train
        this round (node -> why): all of them when too few completed the steps."""
        self.keys = k = _Keys(round=server_round, nodes=list(nodes), threshold=sa.threshold(len(nodes)))
        keys = self._ask(grid, range(len(nodes)), self._spec("keys"))
        keys = {p: r for p, r in keys.items() if {sa.C_PUBLIC + str(p), sa.S_PUBLIC + str(p)} <= set(r.keys())}
        publics = {key: _bytes(r, key) for p, r in keys.items() for key in (sa.C_PUBLIC + str(p), sa.S_PUBLIC + str(p))}
        holders = sorted(keys)
        shared = self._ask(grid, holders, self._spec("shares", holders), {p: publics for p in holders}) \
            if len(holders) >= k.threshold else {}
        for src, record in shared.items():
            for dst in holders:
                key = sa.SEALED + str(dst)
                if dst != src and key in record:
                    k.sealed[(src, dst)] = _bytes(record, key)
        # a position whose sealed shares did not reach every other holder cannot be unmasked by them: it leaves
        k.sharing = [p for p in sorted(shared) if all((p, q) in k.sealed for q in shared if q != p)]
        k.s_public = {p: publics[sa.S_PUBLIC + str(p)] for p in k.sharing}
        if len(k.sharing) < k.threshold:
            why = (f"secure aggregation: {len(k.sharing)} of {len(nodes)} nodes completed the key steps, fewer than "
                   f"the threshold {k.threshold}")
            k.sharing = []
            return {n: why for n in nodes}
        return {n: "secure aggregation: no reply to the key steps" for p, n in enumerate(nodes) if p not in k.sharing}

    def train_parts(self, node: int) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """What ``node``'s TRAIN message adds: the spec of the train step and the shares sealed for it."""
        k = self.keys
        own = k.nodes.index(node)
        sealed = {sa.SEALED + str(src): torch.frombuffer(bytearray(k.sealed[(src, own)]), dtype=torch.uint8)
                  for src in k.sharing if src != own}
        return dict(self._spec("train", k.sharing).to_config()), sealed

    def read(self, record: ArrayRecord, size: int) -> np.ndarray:
        """A reply's masked vector; ValueError unless it is ``size`` uint64 alone."""
        if set(record.keys()) != {sa.MASKED_KEY}:
            raise ValueError(f"secure aggregation: a reply must hold {sa.MASKED_KEY!r} alone, got {sorted(record)[:3]}")
        vector = cast(np.ndarray, record[sa.MASKED_KEY].numpy())
        if vector.dtype != np.uint64 or vector.shape != (size,):
            raise ValueError(f"secure aggregation: a masked vector must be {size} uint64, got {vector.shape} "
                             f"{vector.dtype}")
        return vector

    def unmask(self, grid: Grid, masked: dict[int, np.ndarray]) -> np.ndarray | None:
        """The sum of the vectors in ``masked`` (node -> masked vector, from nodes that got the train step), their
        masks taken off; None (logged) when too few shares came back to rebuild them."""
        k = self.keys
        survivors = sorted(k.nodes.index(n) for n in masked)
        dropped = [p for p in k.sharing if p not in survivors]
        if len(survivors) < k.threshold:
            log(WARNING, "round %d: %d masked replies, fewer than secure aggregation's threshold %d: nothing to "
                "unmask", k.round, len(survivors), k.threshold)
            return None
        replies = self._ask(grid, survivors, self._spec("unmask", survivors, dropped))
        start = time.perf_counter()
        shares: dict[int, list[bytes]] = {p: [] for p in survivors + dropped}
        for record in replies.values():
            for p in shares:
                if sa.SHARE + str(p) in record.keys():
                    shares[p].append(_bytes(record, sa.SHARE + str(p)))
        short = [k.nodes[p] for p, got in shares.items() if len(got) < k.threshold]
        if short:
            log(WARNING, "round %d: secure aggregation got fewer than %d shares for nodes %s: nothing to unmask",
                k.round, k.threshold, short)
            return None
        seeds = {p: combine_shares(shares[p]) for p in survivors}
        secrets = {p: combine_shares(shares[p]) for p in dropped}
        total = np.zeros_like(next(iter(masked.values())))
        for vector in masked.values():
            total += vector
        out = sa.unmask(total, seeds, secrets, k.s_public, survivors)
        k.seconds += time.perf_counter() - start
        return out
