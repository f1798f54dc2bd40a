"""The transfer set of distillation fusion, and the tokenizers small families may bring.

The server distils on public text that no client owns (FedDF's unlabeled server data):

- ``shakespeare``: every (play, speaker) role that is *not* one of the population's clients, so the
  transfer set shares the clients' style but none of their text;
- ``text``: a local ``.txt`` / ``.jsonl`` file (e.g. the KJV's ``kjv.jsonl``, field ``text``).

A family's BPE tokenizer is trained on the transfer text (never on client data) and travels to its
clients as the tokenizer's JSON inside the message spec, so clients stay stateless.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fedfusion.config.choices import FAMILY_TOKENIZERS, TRANSFER_SOURCES
from fedfusion.data.population import client_names
from fedfusion.data.text import build_char_tokenizer, load_shakespeare_roles, load_text_file
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.models.build import family_config

_SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")


def transfer_text(source: str, data_spec: str, max_chars: int, path: str | None = None) -> str:
    """Public text for distillation, disjoint from every client's: at most ``max_chars`` characters.

    ``shakespeare``: the roles of the population's data spec that no client owns, in sorted order,
    each cut to an equal share so that many speakers are represented.
    """
    if source not in TRANSFER_SOURCES:
        raise ValueError(f"transfer source {source!r} is not one of {', '.join(TRANSFER_SOURCES)}")
    if max_chars < 1:
        raise ValueError(f"transfer max_chars must be > 0, got {max_chars}")
    if source == "text":
        if not path:
            raise ValueError("transfer source 'text' needs a path")
        return load_text_file(path)[:max_chars]
    owned = set(client_names(data_spec))
    free = [r for r in load_shakespeare_roles(min_chars=1) if f"{r.play}/{r.speaker}" not in owned]
    if not free:
        raise ValueError("every Shakespeare role belongs to a client: no text is left for the transfer set")
    share = max(1, max_chars // len(free))
    return "\n".join(r.text[:share] for r in free)[:max_chars]


def train_bpe(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on ``text`` (the 4 specials come first).

    Deterministic for a given text; decode(encode(s)) == s.
    """
    if vocab_size < 256 + len(_SPECIALS):
        raise ValueError(f"bpe vocab_size must be >= {256 + len(_SPECIALS)} (bytes + specials), got {vocab_size}")
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([text], trainer=trainer)
    return wrap_tokenizer(backend.to_str())


@lru_cache(maxsize=8)
def wrap_tokenizer(tokenizer_json: str) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` from a ``tokenizers`` JSON string (as sent in a message spec)."""
    pad, unk, bos, eos = _SPECIALS
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json), pad_token=pad, unk_token=unk, bos_token=bos,
        eos_token=eos, clean_up_tokenization_spaces=False,
    )


def family_tokenizer(kind: str, text: str = "", bpe_vocab: int = 512) -> PreTrainedTokenizerFast | None:
    """A family's tokenizer: None for the target's own (``target``), the fixed character tokenizer
    (``char``), or a byte-level BPE of ``bpe_vocab`` ids trained on the transfer ``text`` (``bpe``)."""
    if kind not in FAMILY_TOKENIZERS:
        raise ValueError(f"family tokenizer {kind!r} is not one of {', '.join(FAMILY_TOKENIZERS)}")
    if kind == "target":
        return None
    return build_char_tokenizer() if kind == "char" else train_bpe(text, bpe_vocab)


def distill_families(
    distill: DistillConfig, max_position: int, tokenizer: PreTrainedTokenizerBase, text: str,
) -> dict[str, tuple[PretrainedConfig, PreTrainedTokenizerFast | None]]:
    """Every family of the ``distill`` section: its model config (positions up to the target's ``max_position``)
    and its own tokenizer (None: the target's ``tokenizer``), BPE tokenizers trained on the transfer ``text``.
    What the run trains and the plan prices."""
    families = {}
    for name, f in distill.families.items():
        own = family_tokenizer(f.tokenizer, text, f.bpe_vocab)
        families[name] = (family_config(f.model_type, own or tokenizer, f.hidden_size, f.num_layers, f.num_heads,
                                        f.num_kv_heads, f.intermediate_size, max_position), own)
    return families
