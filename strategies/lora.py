"""Heterogeneous-rank LoRA fusion as a Flower Strategy: every device tier trains peft LoRA adapters of its
own rank (and alpha, and base precision) on one frozen pretrained base; the server folds them together
with one of :data:`fedfusion.lora.METHODS`.

What Flower carries between rounds (``arrays`` of ``configure_train`` / ``aggregate_train`` /
``evaluate_fn``) is the **global update** relative to the original frozen base, one low-rank pair per
adapted module ``m``: ``m.lora_A`` (R, in) and ``m.lora_B`` (out, R) with update ``B @ A`` (scale 1; see
:func:`fedfusion.lora.global_factors`). It is small (no base weights), it is exactly the peft adapter that
:func:`save_adapter` writes (``lora_alpha = r``), and it is all the server needs to serve every rank again:

- fedavg / zeropad / hetlora: the aggregated factors themselves; a rank-r client gets the first r
  components (HetLoRA's truncation), in its own alpha/r scaling.
- flexlora: the averaged update at its numerical rank; a rank-r client gets its best rank-r approximation.
- flora: the sum of every round's stacked updates, merged into the base; clients get it as a frozen
  ``m.merged_*`` update and train fresh adapters on top. Its rank grows with the rounds up to
  min(out, in) (it is recompressed exactly every round), so FLoRA's downlink grows too, up to a dense
  update: a module whose factors would be larger goes as their product (:func:`fedfusion.lora.merged_arrays`).

An empty ArrayRecord means no update yet. Every client is sent its whole starting adapter (served
components in front, fresh seeded ones behind, B = 0), so its reply carries exactly the keys and shapes it
was sent: what Flower's DP mods need to clip ``reply - sent`` (FLoRA's frozen ``m.merged_*`` arrays are
left out of that comparison by :func:`fedfusion.clients.privacy.privacy_mod`).

Node discovery (QUERY round), participation (selector, availability, dropouts), checkpoint state and the
reporting contract (``last: RoundLog`` of ``ClientRound`` rows, ``coverage``, ``aggregate_s``, ``void``,
``fed_eval``, ``clock_s``) are inherited from :class:`SubModelFusion`, so the run recorder treats both
alike. Every tier's width is 1.0 (a LoRA client runs the whole target); ``coverage`` is the largest rank
trained in the round over the largest tier rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path

import torch
from fedfusion.strategies.submodel import (
    ClientRound,
    RoundLog,
    SubModelFusion,
    reply_metrics,
)
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from safetensors.torch import save_file

from fedfusion.energy import WorkCost, lora_work_params, price_work, train_flops
from fedfusion.lora import (
    METHODS,
    ClientLoRA,
    aggregate_lora,
    from_global,
    global_factors,
    merged_arrays,
    serve,
    starting_adapter,
)
from fedfusion.pretrained import QUANTIZE

Shapes = dict[str, tuple[int, int]]


@dataclass
class LoRAClientRound(ClientRound):
    """A clients.jsonl row of a LoRA round: the common fields plus the adapter this client trained.

    ``params`` is priced by the ledger as 6 FLOPs per parameter per token; a frozen base costs 4 (forward
    and activation gradients, no weight gradients), so it holds 2/3 of the base plus the adapter.
    """

    rank: int = 0
    alpha: float = 0.0
    quantize: int = 0
    adapter_params: int = 0


def adapted_modules(model: torch.nn.Module, target_modules: list[str]) -> Shapes:
    """(out, in) of every Linear of ``model`` that peft adapts for ``target_modules`` (a module whose
    name is, or ends with ``.`` +, one of them)."""
    found = {
        name: (module.out_features, module.in_features) for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith(f".{t}") for t in target_modules)
    }
    if not found:
        raise ValueError(f"lora.target_modules {target_modules} match no Linear module of the base")
    return found


def split_global(arrays: ArrayRecord | dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The global update's A and B per module from Flower's arrays (empty dicts before the first update)."""
    state = arrays.to_torch_state_dict() if isinstance(arrays, ArrayRecord) else arrays
    A = {k.removesuffix(".lora_A"): v for k, v in state.items() if k.endswith(".lora_A")}
    B = {k.removesuffix(".lora_B"): v for k, v in state.items() if k.endswith(".lora_B")}
    if set(A) != set(B) or len(A) + len(B) != len(state):
        raise ValueError("global LoRA arrays must be m.lora_A / m.lora_B pairs")
    return A, B


class LoRAFusion(SubModelFusion):
    """Heterogeneous-rank LoRA fusion (zeropad, HetLoRA, FlexLoRA, FLoRA, or FedAvg for one rank).

    ``ranks``/``alphas``/``quantize`` map a device tier to its adapter rank, LoRA alpha and base bits
    (0, 4 or 8); ``modules`` maps each adapted module of the base to its (out, in). ``weighting``:
    ``examples`` (p_k proportional to num-examples, the usual choice for these methods) or ``uniform``.
    """

    def __init__(
        self,
        modules: Shapes,
        ranks: dict[str, int],
        alphas: dict[str, float],
        quantize: dict[str, int],
        method: str,
        base_params: int,
        weighting: str = "examples",
        **common,
    ) -> None:
        """``common``: SubModelFusion's node, participation and reply settings (clients_per_round,
        min_clients, participation, query_config, train_config, evaluate_clients, seed, wait_nodes_s,
        query_timeout_s, max_norm_ratio)."""
        _check(modules, ranks, alphas, quantize, method, weighting)
        # no slicing: every tier runs the whole (frozen) target, so its width is 1
        super().__init__(config=None, widths={tier: 1.0 for tier in ranks}, policy="static", stride=0.0,
                         stagger=False, weighting=weighting, **common)
        self.modules, self.ranks, self.alphas, self.quantize = modules, ranks, alphas, quantize
        self.method, self.base_params = method, base_params
        self.merged: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def summary(self) -> None:
        """Log the strategy's settings."""
        log(INFO, "LoRAFusion: method=%s ranks=%s alphas=%s quantize=%s modules=%d clients/round=%d",
            self.method, self.ranks, self.alphas, self.quantize, len(self.modules), self.clients_per_round)

    def adapter_params(self, tier: str) -> int:
        """Parameters of the adapter a ``tier`` client trains: rank x (out + in) per adapted module."""
        return self.ranks[tier] * sum(o + i for o, i in self.modules.values())

    def tier_costs(self) -> dict[str, WorkCost]:
        """Each tier's planned work priced on its device: the frozen base's forward and activation
        gradients plus the adapter's training, and the adapter's float32 bytes each way (FLoRA's downlink,
        the merged update, grows with the rounds and is counted as sent)."""
        if not self.costs:
            for tier in self.ranks:
                adapter = self.adapter_params(tier)
                params, nbytes = lora_work_params(self.base_params, adapter), 4 * adapter
                self.sizes[tier] = (params, nbytes)
                self.costs[tier] = price_work(self.participation.catalog[tier], train_flops(params, self._tokens()),
                                              nbytes, nbytes)
        return self.costs

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One fresh Message per sampled node: its whole starting adapter at its rank (served components
        in front, fresh ones behind; FLoRA's also carries the frozen merged update) and the spec to build
        the base and adapter."""
        server_round += self.round_offset
        A, B = split_global(arrays)
        agg = from_global(self.method, A, B) if A else None
        self.merged = (A, B) if self.method == "flora" and A else None
        frozen = merged_arrays(A, B) if self.merged is not None else {}  # the same for every client
        self.last = RoundLog(server_round=server_round)
        messages = []
        for node in self.sample(grid, server_round):
            device = self.caps[node]["device"]
            rank, alpha = self.ranks[device], self.alphas[device]
            seed = self.client_seed(server_round, node)
            start = starting_adapter(self.modules, rank, serve(agg, rank, alpha) if agg is not None else None, seed)
            out: dict[str, torch.Tensor] = {}
            for m in self.modules:  # A then B per module: the order the client's reply keeps
                out[f"{m}.lora_A"], out[f"{m}.lora_B"] = start[0][m], start[1][m]
            out.update(frozen)
            record = ArrayRecord(out)
            spec = ConfigRecord({
                **config, **self.train_config, "role": "lora", "server-round": server_round, "method": self.method,
                "rank": rank, "alpha": float(alpha), "quantize": int(self.quantize.get(device, 0)), "seed": seed,
            })
            adapter = self.adapter_params(device)
            self.last.clients[node] = LoRAClientRound(
                node=node, device=device, width=1.0, partition=int(self.caps[node].get("partition", -1)),
                bytes_down=record.count_bytes(), params=lora_work_params(self.base_params, adapter),
                sent_norm=_update_norm(*start, alpha / rank), tokens=self._tokens(),
                rank=rank, alpha=float(alpha), quantize=int(self.quantize.get(device, 0)), adapter_params=adapter,
            )
            messages.append(Message(RecordDict({"arrays": record, "config": spec}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return messages

    def check_reply(self, state: dict[str, torch.Tensor], rank: int) -> tuple[dict, dict]:
        """A reply's A and B per module, or ValueError naming what is wrong: keys, shapes, NaN/Inf."""
        want = {f"{m}.lora_{x}" for m in self.modules for x in "AB"}
        if set(state) != want:
            missing, extra = sorted(want - set(state)), sorted(set(state) - want)
            raise ValueError(f"adapter keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
        A, B = {}, {}
        for m, (out, inp) in self.modules.items():
            a, b = state[f"{m}.lora_A"], state[f"{m}.lora_B"]
            if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
                raise ValueError(f"{m}: A {tuple(a.shape)}, B {tuple(b.shape)}; expected ({rank}, {inp}), ({out}, {rank})")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(f"{m}: A or B holds NaN or Inf")
            A[m], B[m] = a.float(), b.float()
        return A, B

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, aggregate the good adapters with the method; bad replies are rejected and logged."""
        server_round += self.round_offset
        start = time.perf_counter()
        clients, losses, examples = [], [], 0
        for reply, row in self.replies_in_order(server_round, replies):
            try:
                metrics = reply.content["metrics"]
                n, loss, seconds, tokens = reply_metrics(metrics, row)
                A, B = self.check_reply(reply.content["arrays"].to_torch_state_dict(), row.rank)
                row.bytes_up = reply.content["arrays"].count_bytes()
                norm = _update_norm(A, B, row.alpha / row.rank)
                if self.max_norm_ratio and row.sent_norm and norm > self.max_norm_ratio * row.sent_norm:
                    raise ValueError(f"adapter update norm {norm:.3g} is over {self.max_norm_ratio:g}x the norm of "
                                     f"the adapter sent ({row.sent_norm:.3g})")
            except Exception as exc:  # an untrusted reply can be malformed in any way; it must not stop the run
                self.reject(server_round, row, exc)
                continue
            clients.append(ClientLoRA(A, B, row.alpha, float(n) if self.weighting == "examples" else 1.0))
            row.status, row.examples, row.train_loss, row.train_s, row.tokens = "ok", n, loss, seconds, tokens
            losses.append(loss)
            examples += n
        self.close_round(server_round)
        ok = len(clients)
        self.last.void = ok < self.min_clients or ok == 0
        if self.last.void:
            log(WARNING, "round %d: %d good replies < selection.min_clients=%d; global adapter unchanged",
                server_round, ok, self.min_clients)
            self.last.aggregate_s = time.perf_counter() - start
            return None, MetricRecord({"clients_ok": ok})
        A, B = global_factors(aggregate_lora(clients, self.method), self.merged)
        self.last.coverage = max(c.rank for c in clients) / max(self.ranks.values())
        new = ArrayRecord({**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": b for m, b in B.items()}})
        self.last.aggregate_s = time.perf_counter() - start
        return new, MetricRecord({
            "train_loss": sum(losses) / ok, "num-examples": examples, "clients_ok": ok,
            "coverage": self.last.coverage,
        })

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global update (as a frozen ``m.merged_*`` update) to ``evaluate_clients`` known nodes."""
        if self.evaluate_clients <= 0:
            return []
        server_round += self.round_offset
        A, B = split_global(arrays)
        sent = ArrayRecord(merged_arrays(A, B))  # one record for every evaluating node
        nodes = self.evaluation_nodes()
        messages = []
        for n in nodes:
            spec = {**config, **self.train_config, "role": "lora", "server-round": server_round,
                    "quantize": int(self.quantize.get(self.caps[n]["device"], 0))}
            messages.append(Message(RecordDict({"arrays": sent, "config": ConfigRecord(spec)}),
                                    dst_node_id=n, message_type=MessageType.EVALUATE))
        return messages


def _update_norm(A: dict[str, torch.Tensor], B: dict[str, torch.Tensor], scale: float) -> float:
    """Frobenius norm of the whole effective update ``scale * B @ A`` over all modules, from r x r
    products (||B A||^2 = trace(A A^T B^T B))."""
    total = 0.0
    for m, a in A.items():
        a, b = a.double(), B[m].double()
        total += float(((a @ a.T) * (b.T @ b)).sum())
    return scale * max(total, 0.0) ** 0.5


def _check(modules: Shapes, ranks: dict[str, int], alphas: dict[str, float], quantize: dict[str, int],
           method: str, weighting: str) -> None:
    if method not in METHODS:
        raise ValueError(f"lora.method {method!r} is unknown; use one of {', '.join(METHODS)}")
    if weighting not in ("examples", "uniform"):
        raise ValueError(f"lora weighting must be examples or uniform, got {weighting!r}")
    if not modules:
        raise ValueError("no adapted modules")
    if not ranks:
        raise ValueError("lora.ranks is empty")
    smallest = min(min(shape) for shape in modules.values())
    for tier, r in ranks.items():
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= smallest:
            raise ValueError(f"lora.ranks.{tier} must be an int in [1, {smallest}] (the smallest adapted "
                             f"dimension), got {r!r}")
        if tier not in alphas or not alphas[tier] > 0:
            raise ValueError(f"lora alpha of tier {tier!r} must be positive, got {alphas.get(tier)!r}")
    for tier, bits in quantize.items():
        if bits not in QUANTIZE:
            raise ValueError(f"lora.quantize.{tier} must be one of {QUANTIZE}, got {bits!r}")
    if method == "fedavg" and (len(set(ranks.values())) > 1 or len({alphas[t] for t in ranks}) > 1):
        raise ValueError(f"lora.method=fedavg needs one rank and one alpha for every tier, got ranks {ranks}")


# -- outputs: the global adapter (peft format) and the merged target ----------------------------------------
def snapshot(model: torch.nn.Module, modules: Iterable[str]) -> dict[str, torch.Tensor]:
    """Copies of the original weights of ``modules``, so the global update can be re-applied every round."""
    named = dict(model.named_modules())
    return {m: named[m].weight.detach().clone() for m in modules}


@torch.no_grad()
def apply_global(model: torch.nn.Module, original: dict[str, torch.Tensor], arrays: ArrayRecord) -> None:
    """Set each adapted weight of ``model`` to its original value plus the global update ``B @ A``."""
    A, B = split_global(arrays)
    named = dict(model.named_modules())
    for m, w0 in original.items():
        delta = (B[m].double() @ A[m].double()).to(w0.dtype) if m in A else 0
        named[m].weight.copy_(w0 + delta)


def save_adapter(arrays: ArrayRecord, out: str | Path, target_modules: list[str], base: str) -> Path:
    """Write the global update as a peft LoRA adapter in ``out`` (``PeftModel.from_pretrained(base, out)``
    loads it). Every module is zero-padded to the largest rank R and ``lora_alpha = R``, so the adapter's
    update is exactly ``B @ A``."""
    A, B = split_global(arrays)
    if not A:
        raise ValueError("there is no global update to save yet")
    rank = max(a.shape[0] for a in A.values())
    tensors = {}
    for m in sorted(A):
        a, b = A[m].float(), B[m].float()
        pad = rank - a.shape[0]
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.cat([a, a.new_zeros(pad, a.shape[1])]).contiguous()
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.cat([b, b.new_zeros(b.shape[0], pad)], 1).contiguous()
    from peft import LoraConfig  # peft imports bitsandbytes: only where an adapter is written

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=rank, lora_alpha=rank, target_modules=list(target_modules), lora_dropout=0.0, bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path=base).save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def save_merged(model: torch.nn.Module, original: dict[str, torch.Tensor], arrays: ArrayRecord, tokenizer,
                out: str | Path) -> Path:
    """Write the base with the global update merged in (``save_pretrained``, tokenizer included)."""
    apply_global(model, original, arrays)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
