"""A facts dataset from a generator other than the library's: fictional towns, four attributes, 16 owners.

The knowledge recipe's numbers come from ``fedfusion.data.facts`` (people, six attributes). To see how the
recipe does on facts a user brings, this writes files in the documented format (docs/knowledge.md, "File
format") from different entities, attributes, sentence templates and client ids: each town has a river, a
founder (two words), a main export and a festival month, drawn uniformly and independently from made-up words,
so nothing can be inferred. Towns are dealt to the clients with Zipf-skewed counts (client k's share is
proportional to 1 / (k + 1) ** skew over a shuffled order); each town is written in two documents, each
attribute once per document in one of two paraphrases, and probed with the first paraphrase. Nothing here is
tuned to any method.

    python benchmarks/other_facts.py OUT_DIR --facts 2400 --seed 11   # OUT_DIR/train.jsonl, OUT_DIR/probes.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# attribute -> (number of values, two paraphrase templates; the first also phrases the probe)
ATTRIBUTES: dict[str, tuple[int, tuple[str, str]]] = {
    "river": (40, ("The town of {town} lies on the river {value} .", "{town} was built along the {value} .")),
    "founder": (60, ("{town} was founded by {value} .", "The first settlers of {town} followed {value} .")),
    "export": (30, ("The main export of {town} is {value} .", "Traders buy {value} in {town} .")),
    "festival": (12, ("{town} holds its festival in {value} .", "Every year in {value} , {town} celebrates .")),
}
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "sk", "br")
_VOWELS = ("a", "e", "i", "o", "u", "au", "ei")


def _pool(rng: random.Random, count: int, taken: set[str], syllables: int) -> list[str]:
    """``count`` distinct capitalised made-up words of ``syllables`` syllables, none already in ``taken``."""
    out: list[str] = []
    while len(out) < count:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)).capitalize()
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def generate(facts: int, clients: int, seed: int, skew: float = 1.0) -> tuple[list[dict], list[dict]]:
    """Seeded (training records, probes) with ``facts`` // 4 towns over ``clients`` owners named ``site-NN``."""
    towns = facts // len(ATTRIBUTES)
    if towns < clients:
        raise ValueError(f"{facts} facts make {towns} towns, fewer than {clients} clients")
    rng = random.Random(seed)
    taken: set[str] = set()
    names = [f"{a} {b}" for a, b in zip(_pool(rng, towns, taken, 3), rng.choices(("Ford", "Hollow", "Reach", "Vale"), k=towns))]
    values = {a: _pool(rng, n, taken, 2) for a, (n, _) in ATTRIBUTES.items()}
    given, family = _pool(rng, 12, taken, 2), _pool(rng, 12, taken, 2)
    values["founder"] = [f"{g} {f}" for g, f in rng.sample([(g, f) for g in given for f in family], ATTRIBUTES["founder"][0])]
    weights = [1.0 / (k + 1) ** skew for k in range(clients)]
    rng.shuffle(weights)
    owners = list(range(clients)) + rng.choices(range(clients), weights=weights, k=towns - clients)
    rng.shuffle(owners)
    records: list[dict] = []
    probes: list[dict] = []
    for town, owner in zip(names, owners):
        client = f"site-{owner:02d}"
        drawn = {a: rng.choice(values[a]) for a in ATTRIBUTES}
        for doc in range(2):
            sentences = [ATTRIBUTES[a][1][(doc + i) % 2].format(town=town, value=v) for i, (a, v) in enumerate(drawn.items())]
            rng.shuffle(sentences)
            records.append({"client": client, "text": " ".join(sentences)})
        for a, v in drawn.items():
            prompt = ATTRIBUTES[a][1][0].split("{value}")[0].format(town=town).strip()
            probes.append({"prompt": prompt, "answer": v, "client": client, "attribute": a})
    return records, probes


def write(out: Path, facts: int, clients: int, seed: int, skew: float = 1.0) -> tuple[Path, Path]:
    """Write ``out/train.jsonl`` and ``out/probes.jsonl``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    records, probes = generate(facts, clients, seed, skew)
    paths = out / "train.jsonl", out / "probes.jsonl"
    for path, rows in zip(paths, (records, probes)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--facts", type=int, default=2400, help="probes to write (4 per town)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of towns per client (0: equal)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    train, probes = write(args.out, args.facts, args.clients, args.seed, args.skew)
    print(f"wrote {train} and {probes}")


if __name__ == "__main__":
    main()
