"""Federated knowledge: private facts spread over clients, a word-level tokenizer, and probes of recall.

After Allen-Zhu & Li's synthetic biographies (bioS, "Physics of Language Models" 3.1/3.3): fictional people
with independent random attributes, each rendered in several paraphrases, so what a model recalls is
knowledge it stored, not something it could infer. Each client owns a disjoint set of people (its user's
private knowledge): no small model can hold the union, a large enough target can.

The file format (what :func:`write_facts` writes and :func:`load_facts` reads; users bring their own):

- training records, jsonl: ``{"client": <id>, "text": "<one document>"}``; ``client`` is any string or
  integer naming the owner; clients are numbered in sorted order of their ids.
- probes, jsonl: ``{"prompt": "...", "answer": "...", "client": <id>}`` (an optional ``"attribute"`` groups
  them in reports). A probe is answered when greedy decoding after ``prompt`` yields exactly ``answer``.

Every document and probe prompt starts from the tokenizer's ``<bos>``, so a prompt sees the context a
document opens with.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fedfusion.data.bios import ATTRIBUTES, MAX_PEOPLE, SYLLABLES
from fedfusion.data.records import client_order, read_facts
from fedfusion.data.text import as_text, scoring_batch
from fedfusion.data.tier_keys import group_key

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")


@dataclass(frozen=True)
class Probe:
    """One fact to recall: greedy decoding after ``prompt`` must give exactly ``answer``."""

    prompt: str
    answer: str
    client: str
    attribute: str = ""


@dataclass(frozen=True)
class Facts:
    """A facts dataset: each client's documents (clients in sorted id order) and the probes of their facts."""

    clients: tuple[str, ...]
    documents: tuple[tuple[str, ...], ...]  # documents[i]: the training texts of clients[i]
    probes: tuple[Probe, ...]


def _words(prefix: str, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct capitalised two-syllable words (seeded), so names and values are single word tokens."""
    pool = [a + b for a in SYLLABLES for b in SYLLABLES if a != b]
    rng.shuffle(pool)
    return [f"{prefix}{w}".capitalize() for w in pool[:count]]


def _probe_prompt(template: str, name: str) -> str:
    """The template's text before its value: the question a probe asks."""
    return template.split("{value}")[0].format(name=name).strip()


def generate_facts(num_clients: int, people: int, seed: int, skew: float = 1.0, paraphrases: int = 3,
                   public: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """Seeded synthetic biographies: (training records, probes, public records) in the file format.

    ``people`` individuals, each with every attribute of :data:`ATTRIBUTES` drawn uniformly and
    independently, are dealt to ``num_clients`` clients with Zipf-like sizes (client k's share is
    proportional to 1 / (k + 1) ** ``skew``, shuffled; ``skew=0`` is equal shares; each client at least one).
    A person is rendered ``paraphrases`` times, document j using template (j + offset) of each attribute
    in a shuffled sentence order, so every paraphrase of every fact is seen once. Names are first, middle and
    last words drawn from three lists of 40, as bioS composes them. ``public`` more people, owned by nobody,
    form a public transfer set (their biographies only; no probes), drawn by a generator of their own: adding
    them changes no client's data.
    """
    if num_clients < 1 or people < num_clients:
        raise ValueError(f"need people >= num_clients >= 1, got people={people}, num_clients={num_clients}")
    if people + public > MAX_PEOPLE:
        raise ValueError(f"people + public is {people + public}; names from three lists of 40 allow at most {MAX_PEOPLE}")
    if not 1 <= paraphrases <= min(len(t) for _, t in ATTRIBUTES.values()):
        raise ValueError(f"paraphrases must be in 1..3, got {paraphrases}")
    rng = random.Random(seed)
    firsts, middles, lasts = (_words(p, 40, rng) for p in ("", "e", "o"))
    values = {attr: _words("", n, random.Random(f"{seed}-{attr}")) for attr, (n, _) in ATTRIBUTES.items()}
    names: set[str] = set()
    while len(names) < people:
        names.add(f"{rng.choice(firsts)} {rng.choice(middles)} {rng.choice(lasts)}")
    ordered = sorted(names)
    rng.shuffle(ordered)
    weights = [1.0 / (k + 1) ** skew for k in range(num_clients)]
    rng.shuffle(weights)
    extra = people - num_clients  # every client owns one person; the rest go by weight
    counts = [1 + math.floor(extra * w / sum(weights)) for w in weights]
    for k in sorted(range(num_clients), key=lambda k: -weights[k])[: people - sum(counts)]:
        counts[k] += 1
    owners = [k for k, c in enumerate(counts) for _ in range(c)]
    records: list[dict] = []
    probes: list[dict[str, Any]] = []
    for name, owner in zip(ordered, owners):
        facts = _biography(name, values, paraphrases, rng, records, owner)
        probes += [{"prompt": _probe_prompt(ATTRIBUTES[a][1][0], name), "answer": v, "client": owner,
                    "attribute": a} for a, v in facts.items()]
    # the public people come from a generator of their own, so adding them leaves the clients' data unchanged
    public_rng, public_records = random.Random(f"{seed}-public"), list[dict]()
    public_names: list[str] = []
    while len(public_names) < public:
        name = f"{public_rng.choice(firsts)} {public_rng.choice(middles)} {public_rng.choice(lasts)}"
        if name not in names:
            names.add(name)
            public_names.append(name)
    for name in public_names:
        _biography(name, values, paraphrases, public_rng, public_records, -1)
    return records, probes, public_records


def _biography(name: str, values: dict[str, list[str]], paraphrases: int, rng: random.Random, out: list[dict],
               owner: int) -> dict[str, str]:
    """Draw one person's attributes and append their ``paraphrases`` documents to ``out``; returns the facts."""
    facts = {attr: rng.choice(values[attr]) for attr in ATTRIBUTES}
    offset = rng.randrange(paraphrases)
    for j in range(paraphrases):
        sentences = [ATTRIBUTES[a][1][(j + offset) % paraphrases].format(name=name, value=v) for a, v in facts.items()]
        rng.shuffle(sentences)
        out.append({"client": owner, "text": " ".join(sentences)})
    return facts


def write_facts(out: str | Path, num_clients: int, people: int, seed: int, skew: float = 1.0,
                paraphrases: int = 3, public: int = 0) -> dict[str, Path]:
    """Generate a facts dataset into ``out/`` as ``train.jsonl``, ``probes.jsonl`` (and ``public.jsonl``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records, probes, public_records = generate_facts(num_clients, people, seed, skew, paraphrases, public)
    paths = {"train": out / "train.jsonl", "probes": out / "probes.jsonl"}
    parts = [(paths["train"], records), (paths["probes"], probes)]
    if public:
        paths["public"] = out / "public.jsonl"
        parts.append((paths["public"], public_records))
    for path, rows in parts:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)  # a reader never sees half a file
    return paths


def load_facts(train: str | Path, probes: str | Path) -> Facts:
    """A facts dataset from its two files (checked line by line: :func:`fedfusion.data.records.read_facts`)."""
    return facts_from_records(*read_facts(train, probes))


def facts_from_records(records: Iterable[dict], probes: Iterable[dict]) -> Facts:
    """A facts dataset from records in the file format, as :func:`generate_facts` returns them or
    :func:`fedfusion.data.records.read_facts` reads and checks them."""
    docs: dict[str, list[str]] = defaultdict(list)
    for record in records:
        docs[str(record["client"])].append(str(record["text"]))
    order = client_order(docs)
    loaded = [Probe(str(r["prompt"]), str(r["answer"]), str(r["client"]), str(r.get("attribute", ""))) for r in probes]
    return Facts(order, tuple(tuple(docs[c]) for c in order), tuple(loaded))


def build_word_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over every word and punctuation mark of ``texts`` (sorted, so any process that
    reads the same files builds the same ids), with ``<pad> <unk> <bos> <eos>`` first; saved with the model."""
    splitter = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    words = {w for text in texts for w, _ in splitter.pre_tokenize_str(text)}
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *sorted(words - set(SPECIAL_TOKENS))))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = splitter
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    pad, unk, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, unk_token=unk, bos_token=bos,
                                   eos_token=eos, clean_up_tokenization_spaces=False)


def facts_tokenizer(facts: Facts) -> PreTrainedTokenizerFast:
    """The word tokenizer of a facts dataset: every word of its documents, prompts and answers."""
    texts = [d for docs in facts.documents for d in docs]
    return build_word_tokenizer([*texts, *(p.prompt for p in facts.probes), *(p.answer for p in facts.probes)])


def encode_documents(tok: PreTrainedTokenizerBase, documents: Sequence[str], seq_len: int) -> torch.Tensor:
    """(n, seq_len + 1) windows of whole documents, each opened by ``<bos>``, packed in order and padded with
    ``<pad>``; a document longer than a window is cut into window-sized pieces (ValueError if ``seq_len`` < 2)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    width, pad = seq_len + 1, tok.pad_token_id
    rows: list[list[int]] = []
    current: list[int] = []
    for doc in documents:
        ids = [tok.bos_token_id, *tok.encode(doc, add_special_tokens=False)]
        if current and len(current) + len(ids) > width:
            rows.append(current + [pad] * (width - len(current)))
            current = []
        while len(ids) > width:
            rows.append(ids[:width])
            ids = ids[width:]
        current += ids
    if current:
        rows.append(current + [pad] * (width - len(current)))
    return torch.tensor(rows, dtype=torch.long)


@dataclass(frozen=True)
class EncodedProbes:
    """Probes as one padded batch: ``ids`` = <bos> prompt answer, ``answer`` marks the answer positions."""

    ids: torch.Tensor
    answer: torch.Tensor
    entropy: torch.Tensor  # per probe: log2 of the number of distinct answers of its attribute (knowledge bits)


def encode_probes(tok: PreTrainedTokenizerBase, probes: Sequence[Probe]) -> EncodedProbes:
    """Tokenise probes for :func:`probe_metrics`."""
    seqs, marks = [], []
    for p in probes:
        prompt = [tok.bos_token_id, *tok.encode(p.prompt, add_special_tokens=False)]
        # as the documents write it, after a space: a byte-level BPE (a pretrained target's) spells " Kalomi" and
        # "Kalomi" differently; the word tokenizer splits on the space, so its ids are the same either way
        answer = tok.encode(" " + p.answer, add_special_tokens=False)
        seqs.append(prompt + answer)
        marks.append([False] * len(prompt) + [True] * len(answer))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    answer = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, marks)):
        ids[i, : len(s)] = torch.tensor(s)
        answer[i, : len(m)] = torch.tensor(m)
    distinct: dict[str, set[str]] = defaultdict(set)
    for p in probes:
        distinct[p.attribute].add(p.answer)
    entropy = torch.tensor([math.log2(max(2, len(distinct[p.attribute]))) for p in probes])
    return EncodedProbes(ids, answer, entropy)


def probe_metrics(model: torch.nn.Module, probes: EncodedProbes, batch_size: int = 512,
                  groups: Mapping[str, Sequence[int]] | None = None) -> dict[str, float]:
    """``probe_acc``: fraction of probes whose answer greedy decoding reproduces exactly (with teacher forcing,
    the same as decoding: every answer token is the argmax given the right prefix); ``answer_loss``: mean
    nats per answer token; ``knowledge_bits``: sum over probes of log2(answers of its attribute) minus the
    answer's loss in bits, each probe clamped at 0 (Allen-Zhu & Li's bits, estimated from the loss).

    ``groups`` (name -> the indices of its probes, e.g. the probes whose holder is a phone): each non-empty
    group's ``probe_acc`` and ``answer_loss`` as well, under :func:`group_key`."""
    right, nll, tokens = _per_probe(model, probes, batch_size)
    bits = (probes.entropy - nll / math.log(2)).clamp_min(0).sum()
    out = {"probe_acc": float(right.float().mean()), "answer_loss": float(nll.sum()) / max(int(tokens.sum()), 1),
           "knowledge_bits": float(bits)}
    for name, members in (groups or {}).items():
        if members:
            idx = torch.tensor(list(members), dtype=torch.long)
            out[group_key("probe_acc", name)] = float(right[idx].float().mean())
            out[group_key("answer_loss", name)] = float(nll[idx].sum()) / max(int(tokens[idx].sum()), 1)
    return out


def holder_groups(probes: Sequence[Probe], clients: Sequence[str], tiers: Sequence[str],
                  order: Sequence[str] = ()) -> dict[str, list[int]]:
    """The probes' indices grouped by the device tier of the client that holds each fact (``clients`` in
    partition order, ``tiers[partition]`` that partition's tier); tiers in ``order`` (a recipe's mix) first."""
    tier_of = dict(zip(clients, tiers, strict=True))
    groups: dict[str, list[int]] = {t: [] for t in dict.fromkeys([*order, *tiers])}
    for i, p in enumerate(probes):
        groups[tier_of[p.client]].append(i)
    return {t: idx for t, idx in groups.items() if idx}


def probe_hits(model: torch.nn.Module, probes: EncodedProbes, batch_size: int = 512) -> torch.Tensor:
    """Per probe: whether greedy decoding reproduces its answer exactly (what ``probe_acc`` averages)."""
    return _per_probe(model, probes, batch_size)[0]


@torch.no_grad()
def _per_probe(model: torch.nn.Module, probes: EncodedProbes,
               batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per probe: exact match, summed answer nats, answer tokens (on the CPU)."""
    model.eval()
    device = next(model.parameters()).device
    batch_size = scoring_batch(batch_size, probes.ids.shape[1], getattr(getattr(model, "config", None), "vocab_size", 0))
    right, nll, tokens = [], [], []
    for i in range(0, probes.ids.shape[0], batch_size):
        ids, mark = probes.ids[i: i + batch_size].to(device), probes.answer[i: i + batch_size].to(device)
        logits = model(input_ids=ids[:, :-1]).logits.float()
        target, where = ids[:, 1:], mark[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        right.append(((logits.argmax(-1) == target) | ~where).all(dim=1).cpu())
        nll.append((loss * where).sum(dim=1).cpu())
        tokens.append(where.sum(dim=1).cpu())
    return torch.cat(right), torch.cat(nll), torch.cat(tokens)


@torch.no_grad()
def greedy_answer(model: torch.nn.Module, tok: PreTrainedTokenizerBase, prompt: str, max_tokens: int = 4) -> str:
    """The model's greedy continuation of ``<bos> prompt`` up to the first ``.`` or ``max_tokens`` tokens."""
    model.eval()
    ids = torch.tensor([[tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]])
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        if as_text(tok.decode([nxt]), "decode").strip() == ".":  # "." alone, or after a space in a byte-level BPE
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return as_text(tok.decode(out), "decode")
