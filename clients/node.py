"""What a client role keeps on its node between messages: a typed node state, kept in Flower's ``context.state``
(it persists per node: in simulation whichever actor runs the message, and across a deployed SuperNode's
per-message processes).

Every role module (:data:`fedfusion.wire.specs.ROLES`) names its state class ``Node`` (:class:`NodeState`) and takes
one in its ``train``: the client app loads it before the role trains and saves it after, so a role's state is its
own and the client app knows none of it. A role that keeps nothing uses :class:`Stateless`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Self

import torch
from flwr.app import ArrayRecord, RecordDict


class NodeState(Protocol):
    """A role's state on its node, read from and written to the node's ``context.state``."""

    @classmethod
    def load(cls, records: RecordDict) -> Self:
        """The state this node holds (empty on a node that holds none: a new or restarted one)."""
        ...

    def save(self, records: RecordDict) -> None:
        """Keep the state in ``records`` for the node's next message."""
        ...


@dataclass
class Stateless:
    """The node state of a role that keeps nothing between messages."""

    @classmethod
    def load(cls, records: RecordDict) -> Self:
        return cls()

    def save(self, records: RecordDict) -> None:
        """Nothing to keep."""


class StateLost(RuntimeError):
    """A message asks for state its node no longer holds (it restarted): the exception's text starts with
    :data:`~fedfusion.wire.specs.STATE_LOST`, the client app replies it as an error, and the server sends the state
    again."""


@dataclass
class Residual:
    """The uplink's error-feedback residual (``fusion.error_feedback``): what quantising the last reply left out,
    added to the next one (EF-SGD). Any role's reply may be quantised, so the client app keeps it, not a role."""

    KEY: ClassVar[str] = "wire-residual"
    left: dict[str, torch.Tensor] = field(default_factory=dict)  # empty before the node's first quantised reply

    @classmethod
    def load(cls, records: RecordDict) -> Self:
        kept = records.get(cls.KEY)
        return cls(kept.to_torch_state_dict() if isinstance(kept, ArrayRecord) else {})

    def save(self, records: RecordDict) -> None:
        records[self.KEY] = ArrayRecord(self.left)
