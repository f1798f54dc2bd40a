"""The synthetic biographies' vocabulary (:mod:`fedfusion.data.facts` writes them): name syllables, attributes and
their paraphrases. Imports nothing heavy, so a recipe check can count the facts a recipe generates before torch loads.
"""

from __future__ import annotations

MAX_PEOPLE = 40 ** 3 // 2  # distinct names drawn from 40 x 40 x 40 combinations, kept well below the space

# Name parts and attribute values: short made-up words, so no value is guessable from pretraining or spelling.
SYLLABLES = ("ka", "lo", "mi", "ren", "ta", "vo", "sel", "dun", "ar", "bi", "cor", "fen", "gal", "hu", "ist",
              "jo", "mar", "nel", "or", "pra", "qui", "ros", "sul", "tev", "ul", "var", "wen", "yor", "zed", "bre")
# attribute -> (number of values, paraphrase templates; the first also phrases the probe)
ATTRIBUTES: dict[str, tuple[int, tuple[str, ...]]] = {
    "birth_city": (48, ("{name} was born in {value} .", "{name} came from {value} .", "{name} grew up in {value} .")),
    "university": (32, ("{name} studied at {value} .", "{name} graduated from {value} .", "{name} attended {value} .")),
    "major": (24, ("{name} majored in {value} .", "{name} specialised in {value} .", "{name} read {value} .")),
    "employer": (48, ("{name} works for {value} .", "{name} is employed by {value} .", "{name} has a job at {value} .")),
    "hobby": (32, ("{name} enjoys {value} .", "{name} spends weekends on {value} .", "{name} loves {value} .")),
    "pet": (16, ("{name} owns a {value} .", "{name} keeps a {value} .", "{name} lives with a {value} .")),
}


def synthetic_facts(people: int) -> int:
    """How many facts (probes) the synthetic biographies of ``people`` people hold: one per attribute each."""
    return people * len(ATTRIBUTES)
