"""Heterogeneous-rank LoRA as a fusion method: every device tier trains peft LoRA adapters of its own rank (and
alpha, and base precision) on one frozen pretrained base; the fold is one of :data:`fedfusion.config.choices.LORA_METHODS`.

The target this method carries between rounds is the **global update** relative to the original frozen base,
one low-rank pair per adapted module ``m``: ``m.lora_A`` (R, in) and ``m.lora_B`` (out, R) with update ``B @ A``
(scale 1; see :func:`fedfusion.fusion.lora.aggregate.global_factors`). It is small (no base weights), it is exactly the peft
adapter that :func:`save_adapter` writes (``lora_alpha = r``), and it is all the server needs to serve every
rank again:

- fedavg / zeropad / hetlora: the aggregated factors themselves; a rank-r client gets the first r components
  (HetLoRA's truncation), in its own alpha/r scaling.
- flexlora: the averaged update at its numerical rank; a rank-r client gets its best rank-r approximation.
- flora: the sum of every round's stacked updates, merged into the base; clients get it as a frozen
  ``m.merged_*`` update and train fresh adapters on top. Its rank grows with the rounds up to min(out, in) (it
  is recompressed exactly every round), so FLoRA's downlink grows too, up to a dense update: a module whose
  factors would be larger goes as their product (:func:`fedfusion.fusion.lora.aggregate.merged_arrays`).

An empty target means no update yet. Every client is sent its whole starting adapter (served components in
front, fresh seeded ones behind, B = 0), so its reply carries exactly the keys and shapes it was sent: what
Flower's DP mods need to clip ``reply - sent`` (FLoRA's frozen ``m.merged_*`` arrays are left out of that
comparison by :func:`fedfusion.clients.privacy.privacy_mod`). Every tier's width is 1.0 (a LoRA client runs the
whole target); ``coverage`` is the largest rank trained in the round over the largest tier rank.

Under secure aggregation (:mod:`fedfusion.wire.secagg`) a client's change travels padded to one shape for every
rank: fedavg's and zeropad's factor changes zero-padded to the largest tier rank, the dense methods' change of each
module's dense update; the server adds the starting adapters it sent (:func:`~fedfusion.fusion.lora.aggregate.aggregate_sum`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from fedfusion.config.choices import LORA_METHODS, QUANTIZE_BITS
from fedfusion.devices.energy import frozen_work_params
from fedfusion.fusion.base import Client, Fold, FusionMethod, Payload, State, TierCost, Update
from fedfusion.fusion.lora.aggregate import (
    DENSE_METHODS,
    ClientLoRA,
    LoRAAggregate,
    aggregate_lora,
    aggregate_sum,
    from_global,
    global_factors,
    merged_arrays,
    serve,
    starting_adapter,
)
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
from fedfusion.wire import secagg
from fedfusion.wire.finite import all_finite
from fedfusion.wire.quantize import Index, Wire, encoded_bytes, pack_index
from fedfusion.wire.specs import RoleSpec, WireSpec, merge

Shapes = dict[str, tuple[int, int]]


def adapted_modules(model: torch.nn.Module, target_modules: list[str]) -> Shapes:
    """(out, in) of every Linear of ``model`` that peft adapts for ``target_modules`` (a module whose name is, or
    ends with ``.`` +, one of them)."""
    found = {
        name: (module.out_features, module.in_features) for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith(f".{t}") for t in target_modules)
    }
    if not found:
        raise ValueError(f"lora.target_modules {target_modules} match no Linear module of the base")
    return found


def secure_shapes(modules: Shapes, method: str, rank: int) -> dict[str, tuple[int, int]]:
    """The padded change secure aggregation masks, its tensors and shapes: per module its dense update (out, in) for
    the dense methods, else its factors at ``rank`` (the largest tier rank)."""
    if method in DENSE_METHODS:
        return dict(modules)
    return {**{f"{m}.lora_A": (rank, i) for m, (_, i) in modules.items()},
            **{f"{m}.lora_B": (o, rank) for m, (o, _) in modules.items()}}


def split_global(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The global update's A and B per module (empty dicts before the first update)."""
    A = {k.removesuffix(".lora_A"): v for k, v in state.items() if k.endswith(".lora_A")}
    B = {k.removesuffix(".lora_B"): v for k, v in state.items() if k.endswith(".lora_B")}
    if set(A) != set(B) or len(A) + len(B) != len(state):
        raise ValueError("global LoRA arrays must be m.lora_A / m.lora_B pairs")
    return A, B


def update_norm(A: dict[str, torch.Tensor], B: dict[str, torch.Tensor], scale: float) -> float:
    """Frobenius norm of the whole effective update ``scale * B @ A`` over all modules, from r x r products
    (||B A||^2 = trace(A A^T B^T B))."""
    total = 0.0
    for m, a in A.items():
        a, b = a.double(), B[m].double()
        total += float(((a @ a.T) * (b.T @ b)).sum())
    return scale * max(total, 0.0) ** 0.5


class LoRAMethod(FusionMethod):
    """Heterogeneous-rank LoRA fusion (zeropad, HetLoRA, FlexLoRA, FLoRA, or FedAvg for one rank).

    ``ranks``/``alphas``/``quantize`` map a device tier to its adapter rank, LoRA alpha and base bits (0, 4 or
    8); ``modules`` maps each adapted module of the base to its (out, in); ``base`` is what every LoRA client
    needs to load the same base (base, dtype, target modules, dropout).
    """

    name, role, noun = "lora", "lora", "adapter"

    def __init__(self, modules: Shapes, ranks: dict[str, int], alphas: dict[str, float], quantize: dict[str, int],
                 method: str, base_params: int, base: LoRABaseSpec, wire: Wire | None = None) -> None:
        _check(modules, ranks, alphas, quantize, method)
        self.modules, self.ranks, self.alphas, self.quantize = modules, ranks, alphas, quantize
        self.method, self.base_params = method, base_params
        self.base = base
        self.wire = wire or Wire()
        self.merged: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def describe(self) -> str:
        return (f"lora: method={self.method} ranks={self.ranks} alphas={self.alphas} quantize={self.quantize} "
                f"modules={len(self.modules)}")

    def adapter_params(self, tier: str) -> int:
        """Parameters of the adapter a ``tier`` client trains: rank x (out + in) per adapted module."""
        return self.ranks[tier] * sum(o + i for o, i in self.modules.values())

    def tier_cost(self, tier: str) -> TierCost:
        """The frozen base's forward and activation gradients plus the adapter's training, and the adapter's
        bytes each way in the wire's formats (FLoRA's downlink, the merged update, grows with the rounds and is
        counted as sent)."""
        r = self.ranks[tier]

        def nbytes(fmt: str) -> int:
            return sum(encoded_bytes(fmt, r * i) + encoded_bytes(fmt, o * r) for o, i in self.modules.values())

        return TierCost(frozen_work_params(self.base_params, self.adapter_params(tier)), nbytes(self.wire.down),
                        nbytes_up=nbytes(self.wire.up))

    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        """Each client's whole starting adapter at its rank (served components in front, fresh ones behind;
        FLoRA's also carries the frozen merged update) and the spec to build the base and adapter."""
        A, B = split_global(target)
        agg = from_global(self.method, A, B) if A else None
        self.merged = (A, B) if self.method == "flora" and A else None
        frozen = merged_arrays(A, B) if self.merged is not None else {}  # the same for every client
        out = []
        for client in clients:
            rank, alpha = self.ranks[client.tier], self.alphas[client.tier]
            quantize = int(self.quantize.get(client.tier, 0))
            start = starting_adapter(self.modules, rank, serve(agg, rank, alpha) if agg is not None else None,
                                     client.seed)
            arrays: State = {}
            for m in self.modules:  # A then B per module: the order the client's reply keeps
                arrays[f"{m}.lora_A"], arrays[f"{m}.lora_B"] = start[0][m], start[1][m]
            arrays.update(frozen)
            adapter = self.adapter_params(client.tier)
            spec = merge(RoleSpec(self.role), self.base, QuantizeSpec(quantize), AdapterSpec(self.method, rank, alpha),
                         WireSpec(self.wire.up, self.wire.error_feedback))
            out.append(Payload(client, self.wire.send(arrays), spec, width=1.0,
                               params=frozen_work_params(self.base_params, adapter),
                               sent_norm=update_norm(*start, alpha / rank),
                               row={"rank": rank, "alpha": float(alpha), "quantize": quantize,
                                    "adapter_params": adapter}, context=arrays))
        return out

    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        """A reply's A and B per module (a quantised reply's change added to the exact adapter sent), or ValueError
        naming what is wrong: keys, shapes, NaN/Inf."""
        rank, alpha = payload.row["rank"], payload.row["alpha"]
        if not self.wire.lossless:
            reply = self.wire.update(reply, payload.context)
        want = {f"{m}.lora_{x}" for m in self.modules for x in "AB"}
        if set(reply) != want:
            missing, extra = sorted(want - set(reply)), sorted(set(reply) - want)
            raise ValueError(f"adapter keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
        A, B = {}, {}
        for m, (out, inp) in self.modules.items():
            a, b = reply[f"{m}.lora_A"], reply[f"{m}.lora_B"]
            if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
                raise ValueError(f"{m}: A {tuple(a.shape)}, B {tuple(b.shape)}; expected ({rank}, {inp}), ({out}, {rank})")
            if not (all_finite(a) and all_finite(b)):
                raise ValueError(f"{m}: A or B holds NaN or Inf")
            A[m], B[m] = a.float(), b.float()
        return Update(payload, weight, update_norm(A, B, alpha / rank), ClientLoRA(A, B, alpha, weight))

    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        clients = [u.data for u in updates]
        return self._folded(aggregate_lora(clients, self.method), clients)

    def _folded(self, agg: LoRAAggregate, clients: Sequence[ClientLoRA]) -> Fold:
        """The round's global factors from ``agg``, and its coverage: the largest rank ``clients`` trained."""
        A, B = global_factors(agg, self.merged)
        coverage = max(c.rank for c in clients) / max(self.ranks.values())
        return Fold({**{f"{m}.lora_A": a for m, a in A.items()}, **{f"{m}.lora_B": b for m, b in B.items()}}, coverage)

    # -- secure aggregation (fedfusion.fusion.base.SecureFold) ------------------------------------------------------
    def _secure_shapes(self) -> dict[str, tuple[int, int]]:
        return secure_shapes(self.modules, self.method, max(self.ranks.values()))

    def secure_names(self, target: State) -> list[str]:
        return sorted(self._secure_shapes())

    def secure_layout(self, payload: Payload) -> State:
        """Where ``payload``'s change sits in the padded vector: a dense method's per-module update whole (and the
        adapter's scaling, :data:`~fedfusion.wire.secagg.PRODUCT_KEY`, for the client to form it), else the factors'
        first ``rank`` rows of A and columns of B, B's change multiplied by alpha / rank (its scale the inverse)."""
        rank, alpha = int(payload.row["rank"]), float(payload.row["alpha"])
        shapes = self._secure_shapes()
        names = sorted(shapes)
        ids = {name: i for i, name in enumerate(names)}
        index: dict[str, Index]
        extra: State = {}
        if self.method in DENSE_METHODS:
            index = {m: (ids[m], (None, None)) for m in self.modules}
            scales = dict.fromkeys(index, 1.0)
            extra[secagg.PRODUCT_KEY] = torch.tensor([alpha / rank], dtype=torch.float64)
        else:
            keep = torch.arange(rank)
            index = {**{f"{m}.lora_A": (ids[f"{m}.lora_A"], (keep, None)) for m in self.modules},
                     **{f"{m}.lora_B": (ids[f"{m}.lora_B"], (None, keep)) for m in self.modules}}
            scales = {k: 1.0 if k.endswith(".lora_A") else rank / alpha for k in index}
        return {secagg.INDEX_KEY: pack_index(index),
                secagg.SCALES_KEY: torch.tensor([scales[k] for k in sorted(scales)], dtype=torch.float64),
                secagg.SHAPES_KEY: secagg.pack_shapes([shapes[n] for n in names]), **extra}

    def secure_support(self, target: State, payloads: Sequence[Payload]) -> dict[str, torch.Tensor]:
        """The coordinates some payload trains: a dense update whole; of padded factors, the first ``rank``
        components of the largest rank in ``payloads``."""
        shapes = self._secure_shapes()
        held = {name: torch.zeros(shape, dtype=torch.bool) for name, shape in sorted(shapes.items())}
        if self.method in DENSE_METHODS:
            return {name: ~h for name, h in held.items()}
        top = max((int(p.row["rank"]) for p in payloads), default=0)
        for name, h in held.items():
            if name.endswith(".lora_A"):
                h[:top] = True
            else:
                h[:, :top] = True
        return held

    def fold_sum(self, server_round: int, target: State, updates: Sequence[Update], total: State) -> Fold:
        """The round folded as :meth:`fold` folds it, from the starting adapters sent to ``updates``' clients and
        ``total``, the unmasked sum of their weighted changes (:meth:`secure_layout`)."""
        starts = [ClientLoRA({m: u.payload.context[f"{m}.lora_A"] for m in self.modules},
                             {m: u.payload.context[f"{m}.lora_B"] for m in self.modules},
                             float(u.payload.row["alpha"]), u.weight) for u in updates]
        return self._folded(aggregate_sum(self.method, starts, dict(total)), starts)

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        """The global update as a frozen ``m.merged_*`` update on the client's own copy of the base."""
        return merged_arrays(*split_global(target)), merge(RoleSpec(self.role), self.base,
                                                            QuantizeSpec(int(self.quantize.get(tier, 0))))


def _check(modules: Shapes, ranks: dict[str, int], alphas: dict[str, float], quantize: dict[str, int],
           method: str) -> None:
    if method not in LORA_METHODS:
        raise ValueError(f"lora.method {method!r} is unknown; use one of {', '.join(LORA_METHODS)}")
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
        if bits not in QUANTIZE_BITS:
            raise ValueError(f"lora.quantize.{tier} must be one of {QUANTIZE_BITS}, got {bits!r}")
    if method == "fedavg" and (len(set(ranks.values())) > 1 or len({alphas[t] for t in ranks}) > 1):
        raise ValueError(f"lora.method=fedavg needs one rank and one alpha for every tier, got ranks {ranks}")


# -- outputs: the global adapter (peft format) and the merged target ----------------------------------------
def snapshot(model: torch.nn.Module, modules: Iterable[str]) -> dict[str, torch.Tensor]:
    """Copies of the original weights of ``modules``, so the global update can be re-applied every round."""
    named = dict(model.named_modules())
    return {m: named[m].weight.detach().clone() for m in modules}


@torch.no_grad()
def apply_global(model: torch.nn.Module, original: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """Set each adapted weight of ``model`` to its original value plus the global update ``B @ A``."""
    A, B = split_global(state)
    named = dict(model.named_modules())
    for m, w0 in original.items():
        delta = (B[m].double() @ A[m].double()).to(w0.dtype) if m in A else 0
        named[m].weight.copy_(w0 + delta)


def save_adapter(state: Mapping[str, torch.Tensor], out: str | Path, target_modules: list[str], base: str) -> Path:
    """Write the global update as a peft LoRA adapter in ``out`` (``PeftModel.from_pretrained(base, out)`` loads
    it). Every module is zero-padded to the largest rank R and ``lora_alpha = R``, so the adapter's update is
    exactly ``B @ A``."""
    A, B = split_global(state)
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


def save_merged(model: PreTrainedModel, original: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                tokenizer: Any, out: str | Path) -> Path:
    """Write the base with the global update merged in (``save_pretrained``, tokenizer included)."""
    apply_global(model, original, state)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
