"""The units engine's transport seam over a Flower Grid: one ``train.units`` message per node and phase, replies
pulled through the one pull loop (:func:`fedfusion.strategies.wrapped.pull_replies`) until each node's own deadline.

The server of the exact (units) mode trains the target itself; :class:`fedfusion.units.UnitEngine` cuts each
linear layer's GEMMs into tiles and hands each phase's payloads to a transport ``(payloads, deadlines) -> replies``.
This one carries them to the federation's nodes; a node past its deadline answers None and the engine re-dispatches
its tiles.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from fedfusion.strategies.wrapped import pull_replies
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedfusion.wire.specs import UNITS_ACTION, UNITS_ERROR, UNITS_PAYLOAD, UNITS_RECORD, UnitsSpec

TTL_SLACK_S = 30.0  # a message outlives its deadline by this much before Flower drops it undelivered
UNITS_MESSAGE = f"{MessageType.TRAIN}.{UNITS_ACTION}"


def _error_kind(reply: Message) -> bytes | None:
    """An error reply as the engine's transport seam reads it: the ClientApp failed (b"": its units go elsewhere,
    the device stays) or the message never reached a node (None: taken offline)."""
    error: Error = reply.error
    return b"" if error.code in (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION) else None


class Shaper(Protocol):
    """Links emulated for real, as the transport uses them (``fedfusion.units.shaper.Shaper``, built by the run: this
    floor does not import the units core): book a message on a device's downlink or a reply on its uplink, get when
    it arrives, sleep until then, on the shaper's clock."""

    clock: Callable[[], float]

    def down(self, device: int, nbytes: int, ready: float | None = None) -> float: ...

    def up(self, device: int, nbytes: int, ready: float | None = None) -> float: ...

    def wait(self, until: float) -> None: ...


@dataclass
class PhaseWait:
    """One transport round: how long it waited, the longest deadline it had, the devices that missed theirs."""

    waited_s: float
    deadline_s: float
    missed: list[int]


@dataclass
class GridTransport:
    """The engine's transport seam over a Flower Grid: ``(payloads, deadlines) -> replies`` per node index
    (``UnitEngine.slot``; the device index when each device runs one SuperNode).

    Pushes one ``train.units`` message per node (the bytes as one uint8 array), then pulls on its own short
    interval (``poll_s``; not ``send_and_receive``, which sleeps 0.1 s or 3 s between pulls) until every reply is in
    or each missing node's deadline has passed: that node's reply is None (a later reply is never pulled). With a
    ``shaper`` each message is pushed only when its device's downlink would have delivered it and each reply is
    accepted only when the device's uplink would have (``fedfusion.units.shaper``): the real run takes the links'
    time; a reply the uplink delivers past the deadline is missed.
    ``stall`` injects a fault: node index -> (messages it answers first, seconds it then sleeps before replying,
    how many replies it sleeps before (0: every one from then on)).
    """

    grid: Grid
    node_ids: list[int]  # node index -> Flower node id
    floor_s: float = 2.0
    poll_s: float = 0.01
    stall: dict[int, tuple[int, float, int]] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # messages sent per node index
    waits: list[PhaseWait] = field(default_factory=list)  # one per call; calls overlap with micro-batches in flight
    supernodes: int = 1  # per device: ``PhaseWait.missed`` names devices (node index // supernodes)
    # the devices' links emulated for real (``units.shape_links``): each message waits for its device's downlink,
    # each reply for its uplink, before it is handed on (None: loopback as it is)
    shaper: Shaper | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def deadline(self, predicted_s: float) -> float:
        """A device's wall-clock deadline: the engine's, but never below the transport's own latency floor."""
        return max(self.floor_s, predicted_s)

    def message(self, slot: int, payload: bytes, deadline_s: float) -> Message:
        """The ``train.units`` message carrying ``payload`` to node index ``slot`` (with its injected stall, if
        any)."""
        with self._lock:  # one call per micro-batch in flight
            count = self.sent.get(slot, 0)
            self.sent[slot] = count + 1
        after, stall_s, stalled = self.stall.get(slot, (0, 0.0, 0))
        asleep = slot in self.stall and count >= after and (stalled == 0 or count < after + stalled)
        spec = UnitsSpec(stall_s if asleep else 0.0)
        content = RecordDict({UNITS_RECORD: ArrayRecord({UNITS_PAYLOAD: Array(np.frombuffer(payload, np.uint8))}),
                              "config": ConfigRecord(spec.to_config())})
        return Message(content, dst_node_id=self.node_ids[slot], message_type=UNITS_MESSAGE,
                       ttl=deadline_s + TTL_SLACK_S)

    def __call__(self, payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        walls = {slot: self.deadline(deadlines[slot]) for slot in payloads}
        messages = {slot: self.message(slot, payload, walls[slot]) for slot, payload in payloads.items()}
        clock = time.monotonic if self.shaper is None else self.shaper.clock
        start = clock()
        if self.shaper is None:
            got = self._send(messages, start, walls)
        else:
            got = self._shaped(messages, {slot: len(p) for slot, p in payloads.items()}, start, walls, self.shaper)
        replies: dict[int, bytes | None] = {slot: None for slot in payloads}  # past its deadline: None
        replies.update(got)
        missed = sorted({slot // self.supernodes for slot, reply in replies.items() if reply is None})
        self.waits.append(PhaseWait(clock() - start, max(walls.values()), missed))
        return replies

    def _push(self, messages: dict[int, Message]) -> dict[str, int]:
        """Push ``messages`` (node index -> message); their ids -> node index."""
        ids = list(self.grid.push_messages(list(messages.values())))
        if len(ids) != len(messages):
            raise RuntimeError(f"the Grid stored {len(ids)} of {len(messages)} units messages")
        return dict(zip(ids, messages))

    def _send(self, messages: dict[int, Message], start: float, walls: dict[int, float]) -> dict[int, bytes | None]:
        """Every message at once, then the one pull loop until each node's reply or deadline."""
        slot_of = self._push(messages)
        got, _ = pull_replies(self.grid, {mid: start + walls[slot_of[mid]] for mid in slot_of}, self.poll_s)
        return {slot_of[r.metadata.reply_to_message_id]: _reply_bytes(r) for r in got}

    def _shaped(self, messages: dict[int, Message], sizes: dict[int, int], start: float, walls: dict[int, float],
                shaper: Shaper) -> dict[int, bytes | None]:
        """Each message pushed when its device's downlink (``shaper``) has delivered it, each reply accepted when
        the device's uplink has; a reply the uplink delivers past the node's deadline is missed (None)."""
        device = {slot: slot // self.supernodes for slot in messages}
        arrive = {slot: shaper.down(device[slot], sizes[slot], start) for slot in messages}
        unsent, slot_of = sorted(messages, key=arrive.__getitem__), dict[str, int]()
        held: dict[int, tuple[float, bytes | None]] = {}  # node index -> (when its uplink delivers, the reply)
        out: dict[int, bytes | None] = {}
        while unsent or slot_of or held:
            now = shaper.clock()
            due = [slot for slot in unsent if arrive[slot] <= now]
            if due:
                slot_of.update(self._push({slot: messages[slot] for slot in due}))
                unsent = unsent[len(due):]
            for reply in self.grid.pull_messages(list(slot_of)) if slot_of else []:
                slot = slot_of.pop(reply.metadata.reply_to_message_id)
                payload = _reply_bytes(reply)
                held[slot] = (shaper.up(device[slot], len(payload or b"")), payload)
            for mid, slot in list(slot_of.items()):
                if start + walls[slot] <= now:  # unanswered past its deadline: never pulled again
                    del slot_of[mid]
            for slot, (at, payload) in list(held.items()):
                if at > start + walls[slot]:  # its uplink delivers it past the deadline: missed
                    del held[slot]
                elif at <= now:
                    out[slot] = payload
                    del held[slot]
            wake = [arrive[unsent[0]]] if unsent else []
            wake += [at for at, _ in held.values()] + ([now + self.poll_s] if slot_of else [])
            if wake:
                shaper.wait(min(wake))
        return out


def _reply_bytes(reply: Message) -> bytes | None:
    """A node's reply as the engine's transport seam reads it: the result bytes, b"" for an error reply (the node
    could not compute) or None (the message never reached a node)."""
    if reply.has_error():
        return _error_kind(reply)
    if UNITS_ERROR in reply.content:
        return b""
    return reply.content.array_records[UNITS_RECORD][UNITS_PAYLOAD].numpy().tobytes()
