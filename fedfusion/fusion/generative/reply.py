"""Generative (data-free) distillation: each client's own small model writes text, the target learns from it.

Public transfer text cannot carry a client's private facts, and averaging parameters of models trained on
disjoint facts dilutes every client's contribution. Here each client keeps a small model of its own (never
averaged), trains it on its own data, and sends the server a batch of token windows sampled from it (from
``<bos>``, like its training windows). The server trains the target on the latest samples of every client it
has heard from, so knowledge moves as text and the target's size is free of the clients'.

What this reveals: the samples are drawn from a model fitted to the client's private documents, so they
carry the client's facts almost verbatim (that is why they teach the target). Treat them as the client's
data: this method trades the privacy of parameter averaging for recall, and differential privacy on the
small model's training is the remedy, not anything here. With ``top_k`` the samples also carry each position's
``top_k`` most likely next tokens and their log-probabilities under the client's model (a dense teacher signal,
one forward pass over the samples): the same text, with how sure the client's model was of every token.

Where a device's own model lives between rounds is ``device_state``: ``node`` keeps it in the device's node (a
round's reply is its samples), ``server`` has the server hold it and send it both ways every round.

Its client role (:mod:`fedfusion.clients.generative`) writes the reply and the method reads it, so this module sits on
the models floor though in the method's folder (it imports only ``models`` and the method's ``spec``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fedfusion.fusion.generative.spec import GenerativeSpec
from fedfusion.models.build import generate

SAMPLES_KEY = "generated-ids"  # the reply's ArrayRecord key for the sampled token ids, next to the model's keys
TOP_IDS_KEY = "generated-top-ids"  # top_k: each sampled position's k likeliest next tokens (n, seq_len, k) int32
TOP_LOGP_KEY = "generated-top-logp"  # top_k: their log-probabilities under the client's model (n, seq_len, k) float16
TEACHER_KEYS = (TOP_IDS_KEY, TOP_LOGP_KEY)
SAMPLE_KEYS = (SAMPLES_KEY, *TEACHER_KEYS)  # every array of a reply that is not the device's model


@torch.no_grad()
def sample_windows(model: PreTrainedModel, own: torch.Tensor, n: int, temperature: float,
                   seed: int, private: bool = False) -> torch.Tensor:
    """``n`` windows shaped like ``own`` (the client's training windows) sampled from ``model`` (ancestral
    sampling, KV-cached), each opened by the first token of a random own window (``<bos>`` for facts), or, when
    ``private`` (a DP-trained model), by a uniformly random token id, so that nothing of the client's data but what
    the model learned privately goes up; seeded without touching the caller's global random state."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    if private:
        start = torch.randint(int(model.config.vocab_size), (n, 1), generator=gen).to(model.device)
    else:
        start = own[torch.randint(len(own), (n,), generator=gen), :1].to(model.device)
    width = own.shape[1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return generate(model, input_ids=start, attention_mask=torch.ones_like(start), do_sample=True,
                        temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=width - 1,
                        min_new_tokens=width - 1, pad_token_id=int(start[0, 0])).cpu()


@torch.no_grad()
def top_tokens(model: PreTrainedModel, windows: torch.Tensor, k: int, batch_size: int = 64,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's ``k`` likeliest next tokens under ``model`` (temperature 1) for ``windows`` (n, seq_len + 1):
    ids (n, seq_len, k) int32 and log-probabilities float16, the dense teacher signal of ``top_k`` samples."""
    model.eval()
    ids, logp = [], []
    for i in range(0, len(windows), batch_size):
        inputs = windows[i:i + batch_size, :-1].to(model.device)
        log_probs = torch.log_softmax(model(input_ids=inputs).logits.float(), dim=-1)
        top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
        ids.append(top.indices.to(torch.int32).cpu())
        logp.append(top.values.to(torch.float16).cpu())
    return torch.cat(ids), torch.cat(logp)


def samples_reply(model: PreTrainedModel, own: torch.Tensor, ask: GenerativeSpec, seed: int,
                  private: bool = False) -> dict[str, torch.Tensor]:
    """What a client adds to its reply: ``ask.samples`` windows sampled from ``model`` under :data:`SAMPLES_KEY`
    and, with ``ask.top_k``, their teacher arrays under :data:`TEACHER_KEYS` (``private``: see
    :func:`sample_windows`)."""
    samples = sample_windows(model, own, ask.samples, ask.temperature, seed, private)
    if not ask.top_k:
        return {SAMPLES_KEY: samples}
    ids, logp = top_tokens(model, samples, ask.top_k)
    return {SAMPLES_KEY: samples, TOP_IDS_KEY: ids, TOP_LOGP_KEY: logp}


def split_reply(reply: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A client's generative reply as (its device's model, its sample arrays: those under :data:`SAMPLE_KEYS`)."""
    return ({k: v for k, v in reply.items() if k not in SAMPLE_KEYS},
            {k: v for k, v in reply.items() if k in SAMPLE_KEYS})


def check_teacher(ids: torch.Tensor, logp: torch.Tensor, samples: torch.Tensor, k: int, vocab: int) -> None:
    """Raise ValueError unless ``ids``/``logp`` are ``k`` finite log-probabilities (<= 0) of token ids in [0, vocab)
    per position of ``samples``."""
    shape = (samples.shape[0], samples.shape[1] - 1, k)
    if tuple(ids.shape) != shape or tuple(logp.shape) != shape:
        raise ValueError(f"top tokens must be {shape}, got ids {tuple(ids.shape)} and log-probs {tuple(logp.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or not logp.is_floating_point():
        raise ValueError(f"top tokens must be integer ids and float log-probs, got {ids.dtype} and {logp.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"top token ids outside the vocabulary [0, {vocab})")
    if not bool(torch.isfinite(logp).all()) or float(logp.max()) > 1e-3:
        raise ValueError("top log-probabilities must be finite and <= 0")


def check_samples(samples: torch.Tensor, width: int, vocab: int, most: int) -> None:
    """Raise ValueError unless ``samples`` are at most ``most`` windows of ``width`` token ids in [0, vocab)."""
    if samples.dtype not in (torch.int32, torch.int64) or samples.dim() != 2 or samples.shape[1] != width:
        raise ValueError(f"samples must be (n, {width}) integer token ids, got {tuple(samples.shape)} {samples.dtype}")
    if not 0 < samples.shape[0] <= most:
        raise ValueError(f"{samples.shape[0]} sampled windows; expected 1 to {most}")
    if int(samples.min()) < 0 or int(samples.max()) >= vocab:
        raise ValueError(f"sampled token ids outside the vocabulary [0, {vocab})")


class SamplePool:
    """Every client's most recent samples, at most ``cap[client]`` windows each (oldest dropped first): what the
    server trains the target on. A client's newer samples come from a better-trained model. Each entry holds the
    token ids under ``"ids"`` and, with ``top_k``, the teacher arrays (first axis: the window)."""

    def __init__(self) -> None:
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, client: int, arrays: dict[str, torch.Tensor], cap: int) -> None:
        """Append ``client``'s new sample arrays (``"ids"`` and the same keys every time), keeping its newest ``cap``."""
        old = self.kept.get(client)
        if old is not None and set(old) != set(arrays):
            raise ValueError(f"client {client}'s samples hold {sorted(arrays)}, its earlier ones {sorted(old)}")
        self.kept[client] = {k: (v if old is None else torch.cat([old[k], v]))[-cap:] for k, v in arrays.items()}

    def arrays(self) -> dict[str, torch.Tensor]:
        """All clients' kept arrays, each as one tensor (client order)."""
        if not self.kept:
            raise ValueError("no client has sent samples yet")
        order = sorted(self.kept)
        return {k: torch.cat([self.kept[c][k] for c in order]) for k in self.kept[order[0]]}

    def windows(self) -> torch.Tensor:
        """All clients' kept token windows as one tensor (client order)."""
        return self.arrays()["ids"]
