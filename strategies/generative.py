"""Generative distillation as a Flower Strategy: each device keeps a small model of its own and sends samples.

Round flow (``Strategy.start`` drives it; ``arrays`` are the target's state):
1. ``configure_train``: capability query and seeded sampling as in sub-model fusion; each sampled node gets a
   fresh Message with *its own* small model (the static slice of the initial target at its tier's width the first
   time, afterwards the model it returned last; the server holds it for stateless deployed clients) and a spec
   (role ``generative``, model config, samples to write, temperature).
2. ``aggregate_train``: each reply is checked (error, model keys/shapes/NaN, norm; samples shape, count and
   vocabulary) and kept: the model as that device's, its samples in a :class:`~fedfusion.generative.SamplePool`.
   The server then trains the target on every client's latest samples. Fewer than ``min_clients`` good replies
   leave the target unchanged (a void round).

The server sees every client's samples, which carry its private data almost verbatim: see
:mod:`fedfusion.generative`. The server's training is counted in ``server_cost`` and priced like distillation.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from logging import INFO, WARNING

import torch
from fedfusion.strategies.distillation import check_update
from fedfusion.strategies.submodel import ClientRound, RoundLog, SubModelFusion, reply_metrics, state_norm
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfusion.checkpoint import pack_tensors, unpack_tensors
from fedfusion.energy import train_flops
from fedfusion.generative import SAMPLES_KEY, GenerativeConfig, SamplePool, check_samples
from fedfusion.models import model_from_state
from fedfusion.rounds import server_seed
from fedfusion.slicing import extract, plan_slice, sub_config
from fedfusion.training import train_steps


class GenerativeFusion(SubModelFusion):
    """Each tier trains its own small model (a static slice of the target at the tier's width); the target learns
    from the text those models write. Inherits sampling, discovery, reply ordering and checkpointed sampling state."""

    def __init__(self, generative: GenerativeConfig, population: int, **kwargs) -> None:
        super().__init__(policy="static", stride=1.0, stagger=False, **kwargs)
        self.generative, self.population = generative, population
        self.devices: dict[int, dict[str, torch.Tensor]] = {}  # partition -> its own model, as last returned
        self.pool = SamplePool()
        self.examples: dict[int, int] = {}  # partition -> its training windows (caps its samples)
        self.initial: dict[str, torch.Tensor] | None = None  # the target before round 1: what device models start from
        self.sent: dict[int, dict[str, torch.Tensor]] = {}  # node -> the model sent this round (a reply must match it)

    def summary(self) -> None:
        """Log the strategy's settings."""
        log(INFO, "GenerativeFusion: widths=%s samples/window=%s server_steps=%d clients/round=%d",
            self.widths, self.generative.sample_fraction, self.generative.server_steps, self.clients_per_round)

    def state_dict(self) -> dict:
        """Sampling state, every device's model and the sample pool (safetensors, base64) for a resumed run."""
        return {**super().state_dict(), "examples": self.examples,
                "devices": {str(p): pack_tensors(s) for p, s in self.devices.items()},
                "pool": {str(p): pack_tensors({"ids": w}) for p, w in self.pool.kept.items()},
                "initial": pack_tensors(self.initial) if self.initial is not None else None}

    def load_state_dict(self, state: dict, rounds_done: int) -> None:
        """Continue from a checkpoint taken after ``rounds_done`` rounds."""
        super().load_state_dict(state, rounds_done)
        self.examples = {int(p): int(n) for p, n in state["examples"].items()}
        self.devices = {int(p): unpack_tensors(s) for p, s in state["devices"].items()}
        self.pool.kept = {int(p): unpack_tensors(s)["ids"] for p, s in state["pool"].items()}
        self.initial = unpack_tensors(state["initial"]) if state["initial"] else None

    # tier_costs is sub-model fusion's: a tier's own model is the static slice at its width, priced both ways
    # (samples are small next to it and counted when they arrive)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One fresh Message per sampled node: its own small model and the spec to train and sample it."""
        server_round += self.round_offset
        self.target = arrays.to_torch_state_dict()
        if self.initial is None:
            self.initial = {k: v.clone() for k, v in self.target.items()}
        self.last = RoundLog(server_round=server_round)
        self.sent = {}
        messages = []
        for node in self.sample(grid, server_round):
            device, partition = self.caps[node]["device"], self.partition_of(node)
            width = self.widths[device]
            plan = plan_slice(self.config, width, "static", axes=self.axes, scale=self.scale)
            own = self.devices.get(partition) or extract(self.initial, self.config, plan)
            sent = self.sent[node] = self.wire(own)
            sub = ArrayRecord(sent)
            # the client's own count of training windows, capped by the server: a client cannot claim the pool
            windows = min(int(self.caps[node].get("examples", 1)), self.generative.max_windows)
            self.examples[partition] = windows
            spec = ConfigRecord({
                **config, **self.train_config, "role": "generative", "server-round": server_round, "width": width,
                "model-config": json.dumps(sub_config(self.config, plan).to_dict()),
                "seed": self.client_seed(server_round, node),
                "samples": math.ceil(self.generative.sample_fraction * windows),
                "temperature": self.generative.temperature,
            })
            self.last.clients[node] = ClientRound(
                node=node, device=device, width=width, partition=int(self.caps[node].get("partition", -1)),
                bytes_down=sub.count_bytes(), params=sum(t.numel() for t in sent.values()),
                sent_norm=state_norm(sent), tokens=self._tokens())
            messages.append(Message(RecordDict({"arrays": sub, "config": spec}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Keep each good reply's model and samples, then train the target on every client's latest samples."""
        server_round += self.round_offset
        start = time.perf_counter()
        self.server_cost = {"flops": 0.0, "seconds": 0.0, "tokens": 0.0}  # a void round trains nothing
        losses, width = [], int(self.train_config["seq-len"]) + 1
        for reply, row in self.replies_in_order(server_round, replies):
            partition = self.partition_of(row.node)
            try:
                arrays = reply.content["arrays"].to_torch_state_dict()
                samples = arrays.pop(SAMPLES_KEY, None)
                if samples is None:
                    raise ValueError(f"reply has no {SAMPLES_KEY!r} array")
                n, loss, seconds, tokens = reply_metrics(reply.content["metrics"], row)
                check_update(arrays, self.sent[row.node])
                if self.max_norm_ratio and state_norm(arrays) > self.max_norm_ratio * row.sent_norm:
                    raise ValueError(f"update norm {state_norm(arrays):.3g} is over {self.max_norm_ratio:g}x the "
                                     f"norm of the model sent ({row.sent_norm:.3g})")
                check_samples(samples, width, self.config.vocab_size, math.ceil(
                    self.generative.sample_fraction * self.examples.get(partition, 1)))
            except Exception as exc:  # an untrusted reply can be malformed in any way; it must not stop the run
                self.reject(server_round, row, exc)
                continue
            row.bytes_up = reply.content["arrays"].count_bytes()
            self.devices[partition] = {k: v.float() if v.is_floating_point() else v for k, v in arrays.items()}
            self.pool.add(partition, samples.long(), cap=max(1, self.examples.get(partition, 1)))
            row.status, row.examples, row.train_loss, row.train_s, row.tokens = "ok", n, loss, seconds, tokens
            losses.append(loss)
        self.close_round(server_round)
        ok = len(losses)
        self.last.void = ok < self.min_clients
        if self.last.void:
            log(WARNING, "round %d: %d good replies < selection.min_clients=%d; target unchanged",
                server_round, ok, self.min_clients)
            self.last.aggregate_s = time.perf_counter() - start
            return None, MetricRecord({"clients_ok": ok})
        target = model_from_state(self.config, self.target)
        g = self.generative
        out = train_steps(target, self.pool.windows(), g.server_steps, g.server_lr, g.server_batch,
                          server_seed(int(self.train_config.get("seed", 0)), server_round, self.population))
        params = sum(p.numel() for p in target.parameters())
        self.server_cost = {"flops": train_flops(params, int(out["train_tokens"])), "seconds": out["train_s"],
                            "tokens": out["train_tokens"]}
        self.last.coverage = 1.0
        self.last.aggregate_s = time.perf_counter() - start
        new = {k: v.detach().clone() for k, v in target.state_dict().items()}
        return ArrayRecord(new), MetricRecord({"train_loss": sum(losses) / ok, "clients_ok": ok,
                                               "server_loss": out["train_loss"]})
