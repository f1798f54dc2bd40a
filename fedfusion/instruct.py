"""Instruction pairs for LoRA fine-tuning: the chatterbot corpus by category, chat formatting with the loss
on responses only, and training / evaluation / generation on such data (plain torch, no Flower).

Data: PyPI ``chatterbot-corpus`` holds YAML files of conversations, one file per category (ai, coding,
trivia, ...). Every consecutive pair of turns in a conversation is one (prompt, response) pair. Each
category keeps a seeded ``held_out`` share of its pairs for evaluation. Clients split the rest either by
category (``split="category"``: natural non-IID, each client holds whole categories or a share of one) or
by a seeded shuffle (``split="iid"``).

Formatting: with a chat template, a pair is the user turn plus the assistant turn as the tokenizer renders
them; the prompt part (everything the template renders before the response, found as the longest common
token prefix of the prompt-with-generation-prompt and the full chat) gets label -100, so the loss covers the
response and the template's end-of-turn tokens only. A tokenizer with no chat template uses
``"Question: {prompt}\\nAnswer: "`` followed by ``"{response}"`` and the eos token, masked the same way.
Sequences are cut at ``max_len`` tokens on the right; a pair with no response token left is dropped.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:  # peft imports bitsandbytes: the LoRA client role loads it, not every user of this module
    from peft import PeftModel

from fedfusion.data import as_text
from fedfusion.models import generate
from fedfusion.training import optimizer_step, seeded_randomness

IGNORE = -100
FALLBACK_PROMPT = "Question: {prompt}\nAnswer: "
SPLITS = ("category", "iid")


@dataclass(frozen=True)
class Pair:
    """One instruction: a prompt, the response to learn, and the category it came from."""

    prompt: str
    response: str
    category: str = ""


@dataclass
class InstructData:
    """Encoded pairs, right-padded to one length: ids, labels (-100 outside responses) and attention mask."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    dropped: int = 0  # pairs left out because truncation removed their whole response

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows ``index``, trimmed to their longest sequence."""
        mask = self.attention_mask[index]
        width = int(mask.sum(1).max())
        return self.input_ids[index, :width], self.labels[index, :width], mask[:, :width]


@dataclass(frozen=True)
class ClientPairs:
    """One client's instruction data: training pairs, held-out pairs and the categories they come from."""

    train: tuple[Pair, ...]
    held_out: tuple[Pair, ...]
    categories: tuple[str, ...]


# -- the corpus ---------------------------------------------------------------------------------------
@lru_cache(maxsize=2)
def load_chatterbot(language: str = "english") -> dict[str, tuple[Pair, ...]]:
    """Every distinct (turn, next turn) pair of the chatterbot corpus in ``language``, by category (file
    name). Entries that are not a list of turns (one malformed trivia entry) are skipped; tech_support
    repeats 10 pairs about a hundred times each, which count once."""
    spec = find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data.source=chatterbot needs the PyPI package chatterbot-corpus: "
                         "pip install --no-deps chatterbot-corpus==1.3.3")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / language
    if not folder.is_dir():
        raise ValueError(f"chatterbot-corpus has no language {language!r}")
    corpus = {}
    for path in sorted(folder.glob("*.yml")):
        conversations = yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []
        pairs = [
            Pair(str(turns[i]).strip(), str(turns[i + 1]).strip(), path.stem)
            for turns in conversations if isinstance(turns, list) for i in range(len(turns) - 1)
        ]
        if pairs:
            corpus[path.stem] = tuple(dict.fromkeys(pairs))  # repeated pairs once, first-seen order
    return corpus


def split_held_out(corpus: dict[str, tuple[Pair, ...]], held_out: float, seed: int
                   ) -> tuple[dict[str, list[Pair]], dict[str, list[Pair]]]:
    """(train, held-out) per category: a seeded shuffle of each category, its last ``held_out`` share
    (at least one pair when the category has two or more) held out."""
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")
    train, held = {}, {}
    for category in sorted(corpus):
        pairs = list(corpus[category])
        random.Random(f"{seed}:{category}").shuffle(pairs)
        n = min(len(pairs) - 1, max(1, round(len(pairs) * held_out))) if len(pairs) > 1 else 0
        train[category], held[category] = pairs[: len(pairs) - n], pairs[len(pairs) - n:]
    return train, held


def partition_pairs(train: dict[str, list[Pair]], held: dict[str, list[Pair]], num_clients: int,
                    split: str, seed: int) -> list[ClientPairs]:
    """Deal the pairs out to ``num_clients`` clients.

    ``category``: with at most as many clients as categories, client i holds categories i, i + n, ...
    (sorted by name); with more clients, client i holds a seeded share of category i mod C, shared with the
    other clients of that category, and that category's held-out pairs. ``iid``: a seeded shuffle of every
    pair dealt round-robin.
    """
    if split not in SPLITS:
        raise ValueError(f"data split must be one of {', '.join(SPLITS)}, got {split!r}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    categories = sorted(c for c in train if train[c])
    if not categories:
        raise ValueError("no training pairs to partition")
    rng = random.Random(seed)
    if split == "iid":
        pairs = [p for c in categories for p in train[c]]
        rng.shuffle(pairs)
        held_pairs = [p for c in categories for p in held.get(c, [])]
        rng.shuffle(held_pairs)
        clients = [ClientPairs(tuple(pairs[i::num_clients]), tuple(held_pairs[i::num_clients]), tuple(categories))
                   for i in range(num_clients)]
    elif num_clients <= len(categories):
        clients = []
        for i in range(num_clients):
            mine = categories[i::num_clients]
            clients.append(ClientPairs(tuple(p for c in mine for p in train[c]),
                                       tuple(p for c in mine for p in held.get(c, [])), tuple(mine)))
    else:
        members = {c: [i for i in range(num_clients) if categories[i % len(categories)] == c] for c in categories}
        clients = []
        for i in range(num_clients):
            c = categories[i % len(categories)]
            pairs = list(train[c])
            random.Random(f"{seed}:{c}:shares").shuffle(pairs)
            share = members[c].index(i)
            clients.append(ClientPairs(tuple(pairs[share::len(members[c])]), tuple(held.get(c, [])), (c,)))
    for i, client in enumerate(clients):
        if not client.train:
            raise ValueError(
                f"client {i} ({', '.join(client.categories)}) gets no training pair; use fewer clients or split=iid"
            )
    return clients


@lru_cache(maxsize=8)
def instruct_clients(spec: str) -> tuple[ClientPairs, ...]:
    """Every client's pairs from a JSON data spec ``{"source": "chatterbot", "language", "num_clients",
    "split", "held_out", "seed"}``; deterministic, so server and clients agree without exchanging data."""
    s = json.loads(spec)
    if s.get("source") == "dataset":
        from fedfusion.federated_data import instruct_clients as dataset_clients

        return dataset_clients(spec)
    if s.get("source") != "chatterbot":
        raise ValueError(f"instruction data source must be 'chatterbot' or 'dataset', got {s.get('source')!r}")
    train, held = split_held_out(load_chatterbot(s.get("language", "english")), float(s.get("held_out", 0.1)),
                                 int(s.get("seed", 0)))
    return tuple(partition_pairs(train, held, int(s["num_clients"]), s.get("split", "category"),
                                 int(s.get("seed", 0))))


def pooled_held_out(spec: str, max_pairs: int | None = None) -> list[Pair]:
    """The held-out pairs of every category (each once), or of every client of a dataset, in a seeded order, at
    most ``max_pairs``."""
    s = json.loads(spec)
    if s.get("source") == "dataset":
        pairs = [p for c in instruct_clients(spec) for p in c.held_out]
        random.Random(int(s["seed"])).shuffle(pairs)
        return pairs[:max_pairs] if max_pairs else pairs
    _, held = split_held_out(load_chatterbot(s.get("language", "english")), float(s.get("held_out", 0.1)),
                             int(s.get("seed", 0)))
    pairs = [p for c in sorted(held) for p in held[c]]
    random.Random(int(s.get("seed", 0))).shuffle(pairs)
    return pairs[:max_pairs] if max_pairs else pairs


# -- formatting ---------------------------------------------------------------------------------------
def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The text a model continues to answer ``prompt``: the chat template's user turn plus generation
    prompt, or the documented fallback."""
    if tokenizer.chat_template:
        return as_text(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True), "apply_chat_template")
    return FALLBACK_PROMPT.format(prompt=prompt)


def encode_pair(tokenizer: PreTrainedTokenizerBase, pair: Pair, max_len: int) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) of one pair, labels -100 outside the response; None if truncation to ``max_len``
    leaves no response token."""
    prompt_ids = _ids(tokenizer, prompt_text(tokenizer, pair.prompt))
    if tokenizer.chat_template:
        full = as_text(tokenizer.apply_chat_template(
            [{"role": "user", "content": pair.prompt}, {"role": "assistant", "content": pair.response}],
            tokenize=False), "apply_chat_template")
        full_ids = _ids(tokenizer, full)
    else:
        full_ids = prompt_ids + _ids(tokenizer, pair.response)
        if tokenizer.eos_token_id is not None:
            full_ids.append(tokenizer.eos_token_id)
    start = 0
    while start < min(len(prompt_ids), len(full_ids)) and prompt_ids[start] == full_ids[start]:
        start += 1
    full_ids = full_ids[:max_len]
    if start >= len(full_ids):
        return None
    return full_ids, [IGNORE] * start + full_ids[start:]


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[Pair] | tuple[Pair, ...], max_len: int) -> InstructData:
    """Encode ``pairs`` and right-pad them to the longest kept sequence (pad id from the tokenizer)."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad with")
    encoded = [e for e in (encode_pair(tokenizer, p, max_len) for p in pairs) if e is not None]
    if not encoded:
        raise ValueError(f"no pair keeps a response token within max_len={max_len}")
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return InstructData(input_ids, labels, mask, dropped=len(pairs) - len(encoded))


# -- training and evaluation --------------------------------------------------------------------------
def response_loss(model: PreTrainedModel | PeftModel, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                  reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy on response tokens only; also the shifted logits and labels."""
    ids, labels, mask = ids.to(model.device), labels.to(model.device), mask.to(model.device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=IGNORE, reduction=reduction)
    return loss, logits, target


def train_instruct(model: PreTrainedModel | PeftModel, data: InstructData, steps: int, lr: float, batch_size: int,
                   seed: int, weight_decay: float = 0.0) -> dict[str, float]:
    """``steps`` AdamW steps over the trainable parameters on seeded random batches of ``data``;
    mean loss, tokens processed and seconds."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.train()
    start, total, tokens = time.perf_counter(), 0.0, 0
    with seeded_randomness(seed, next(model.parameters()).device):
        for _ in range(steps):
            ids, labels, mask = data.rows(torch.randint(len(data), (batch_size,), generator=gen))
            loss, _, _ = response_loss(model, ids, labels, mask)
            total += optimizer_step(opt, loss)
            tokens += int(mask.sum())
    return {"train_loss": total / steps, "train_tokens": float(tokens), "train_s": time.perf_counter() - start}


@torch.no_grad()
def evaluate_instruct(model: PreTrainedModel, data: InstructData, batch_size: int = 16) -> dict[str, float]:
    """Mean loss, perplexity and next-token accuracy over every response token of ``data``."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(data), batch_size):
        ids, labels, mask = data.rows(torch.arange(i, min(i + batch_size, len(data))))
        loss, logits, target = response_loss(model, ids, labels, mask, reduction="sum")
        scored = target != IGNORE
        loss_sum += loss.item()
        correct += int(((logits.argmax(-1) == target) & scored).sum())
        count += int(scored.sum())
    mean = loss_sum / count
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_acc": correct / count}


@torch.no_grad()
def generate_responses(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                       max_new_tokens: int = 40) -> list[str]:
    """Greedy answers to ``prompts`` (formatted as in training), for the report."""
    model.eval()
    answers = []
    for prompt in prompts:
        ids = torch.tensor([_ids(tokenizer, prompt_text(tokenizer, prompt))])
        out = generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers.append(as_text(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), "decode").strip())
    return answers
