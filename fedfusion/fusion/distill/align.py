"""Teachers with another tokenizer: align two tokenizations of the same text and map a teacher's
next-token distribution onto the student's vocabulary.

How (FedMKT-style, specialised to what a next-token teacher can say):

1. **Surfaces.** Every token has a surface string (``tokenizer.decode([id])``; special tokens are
   empty). A window's text is the concatenation of its student tokens' surfaces; the teacher
   tokenises that text itself.
2. **Character alignment by dynamic programming.** The concatenated teacher surfaces usually equal the
   student's text, and then the alignment is the identity. When they differ (normalisation, unknown
   tokens, markers a decoder drops) :func:`char_alignment` aligns the two strings by edit distance
   (Levenshtein DP with backtrace) and every student character gets the teacher character it matched,
   or none.
3. **Prefix marginalisation.** Student position i predicts student token i+1, starting at character c.
   Let teacher token j cover the aligned character, ``m`` characters into it, with prefix
   ``s = surface_j[:m]``. The teacher's prediction for token j (its output at j-1) is a distribution
   over whole teacher tokens; conditioned on the prefix already written, each teacher token t that
   starts with s and goes on implies the student's next token: the first student token of
   ``surface_t[m:]``. Summing p(t) over the tokens implying each student token and renormalising gives
   the teacher's distribution over the student vocabulary at position i.

Exact and approximate cases, and the limits:

- **Same vocabulary**: no alignment at all (:attr:`TokenBridge.same`); the teacher's logits are used as
  they are.
- **Character-level student** (every student token is one character, e.g. the target's char tokenizer),
  from any teacher (BPE, word-piece ...): step 3 is exact marginalisation of the teacher's next-token
  distribution onto the next character, except that teacher tokens equal to the prefix itself (whose
  next character would come from the token after) are left out, and positions in the first teacher
  token (no teacher context) or on unaligned characters are masked.
- **Subword student** (e.g. BPE family learning from the char target): a student token can be longer
  than what the teacher's single next token covers (from a char teacher, always: the teacher predicts one
  character). Position i is kept only where the student's actual next token fits inside the teacher
  token that covers it (``len(gold) <= len(surface_j) - m``); elsewhere it is masked, and the student
  learns there from the LM loss if the recipe mixes it in. The first-student-token rule is an
  approximation: a teacher token whose remainder the student would tokenise differently in context is
  credited to its isolated tokenisation's first token.
- Byte-level tokens that are not whole UTF-8 characters decode to U+FFFD and align only by the DP; the
  shipped corpora are ASCII, where this does not arise.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fedfusion.data.text import as_text


def vocab_surfaces(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Surface string of every id in the vocabulary (special tokens are empty strings)."""
    special = set(tokenizer.all_special_ids)
    return ["" if i in special else as_text(tokenizer.decode([i]), "decode") for i in range(len(tokenizer))]


def char_alignment(src: str, dst: str) -> np.ndarray:
    """For each character of ``src``, the index of the ``dst`` character aligned to it, or -1.

    Minimal edit-distance alignment (Levenshtein: substitution, insertion, deletion cost 1) found by
    dynamic programming with backtrace; matches and substitutions align, inserted/deleted characters do
    not. Identical strings align to the identity without running the DP. Each DP row is computed with
    vectorised numpy (insertions by a running minimum), O(len(src) x len(dst)) memory.
    """
    if src == dst:
        return np.arange(len(src))
    n, m = len(src), len(dst)
    a = np.frombuffer(src.encode("utf-32-le"), dtype=np.uint32)
    b = np.frombuffer(dst.encode("utf-32-le"), dtype=np.uint32)
    cols = np.arange(m + 1)
    dist = np.empty((n + 1, m + 1), dtype=np.int64)
    dist[0] = cols
    for i in range(1, n + 1):
        best = np.minimum(dist[i - 1, :-1] + (a[i - 1] != b), dist[i - 1, 1:] + 1)  # substitute | delete
        start = np.concatenate(([i], best))
        dist[i] = np.minimum.accumulate(start - cols) + cols  # insertions run left to right
    out = np.full(n, -1, dtype=np.int64)
    i, j = n, m
    while i > 0 and j > 0:
        if dist[i, j] == dist[i - 1, j - 1] + (a[i - 1] != b[j - 1]):
            out[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif dist[i, j] == dist[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return out


def token_starts(surfaces: list[str]) -> np.ndarray:
    """Character offset at which each token starts in the concatenation of ``surfaces``."""
    lengths = np.fromiter((len(s) for s in surfaces), dtype=np.int64, count=len(surfaces))
    return np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(surfaces) else lengths


@dataclass
class BridgedWindows:
    """A set of student windows prepared for one teacher tokenizer (computed once, indexed by row).

    ``teacher_ids`` (n, Lt) right-padded with ``attention_mask``; for student position (r, i):
    ``source[r, i]`` the teacher position whose output predicts it (-1: masked) and ``prefix[r, i]`` the
    index of its prefix in :attr:`TokenBridge.prefixes`.
    """

    teacher_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    prefix: torch.Tensor


class TokenBridge:
    """Maps a teacher tokenizer's next-token distributions onto a student tokenizer's vocabulary."""

    def __init__(self, teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase) -> None:
        self.teacher, self.student = teacher, student
        self.same = teacher.get_vocab() == student.get_vocab()
        self.t_surface = vocab_surfaces(teacher)
        self.s_surface = vocab_surfaces(student)
        self.char_student = all(len(s) <= 1 for s in self.s_surface)
        self._s_ids = {s: i for i, s in enumerate(self.s_surface) if s}
        # teacher tokens sorted by surface: those starting with a prefix form one contiguous run
        ranked = sorted((s, t) for t, s in enumerate(self.t_surface) if s)
        self._sorted_surface = [s for s, _ in ranked]
        self._sorted_ids = [t for _, t in ranked]
        self.prefixes: list[str] = []
        self._prefix_id: dict[str, int] = {}
        self._candidates: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._first: dict[str, int] = {}

    def _first_student_token(self, text: str) -> int:
        """The student id of the first token of ``text`` tokenised alone (-1 if it yields none)."""
        if text not in self._first:
            if self.char_student:
                self._first[text] = self._s_ids.get(text[0], -1)
            else:
                ids = self.student.encode(text, add_special_tokens=False)
                self._first[text] = ids[0] if ids else -1
        return self._first[text]

    def _prefix(self, prefix: str) -> int:
        """Index of ``prefix``, building its (teacher ids, student ids) candidate lists on first use."""
        if prefix not in self._prefix_id:
            m = len(prefix)
            lo = bisect_left(self._sorted_surface, prefix)
            hi = bisect_left(self._sorted_surface, prefix + "\U0010ffff", lo)
            pairs = [(self._sorted_ids[k], self._first_student_token(self._sorted_surface[k][m:]))
                     for k in range(lo, hi) if len(self._sorted_surface[k]) > m]
            pairs = [(t, u) for t, u in pairs if u >= 0]
            t_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
            s_ids = torch.tensor([u for _, u in pairs], dtype=torch.long)
            self._prefix_id[prefix] = len(self.prefixes)
            self.prefixes.append(prefix)
            self._candidates.append((t_ids, s_ids))
        return self._prefix_id[prefix]

    def prepare(self, windows: torch.Tensor, max_teacher_len: int | None = None) -> BridgedWindows:
        """Tokenise each student window's text for the teacher and locate every position's source."""
        if self.same:
            raise ValueError("teacher and student share a vocabulary: use the teacher's logits directly")
        rows, length = windows.shape
        sources = torch.full((rows, length - 1), -1, dtype=torch.long)
        prefixes = torch.zeros((rows, length - 1), dtype=torch.long)
        teacher_rows = []
        for r in range(rows):
            s_tokens = [self.s_surface[i] for i in windows[r].tolist()]
            text = "".join(s_tokens)
            t_ids = self.teacher.encode(text, add_special_tokens=False)
            if max_teacher_len is not None and len(t_ids) > max_teacher_len:
                raise ValueError(f"window {r}: the teacher needs {len(t_ids)} tokens, over its limit {max_teacher_len}")
            t_tokens = [self.t_surface[i] for i in t_ids]
            t_text = "".join(t_tokens)
            to_teacher = char_alignment(text, t_text)
            # teacher token covering each teacher character
            owner = np.repeat(np.arange(len(t_tokens)), [len(s) for s in t_tokens])
            t_start = token_starts(t_tokens)
            s_start = token_starts(s_tokens)
            for i in range(length - 1):
                gold = s_tokens[i + 1]
                if not gold:
                    continue
                c = to_teacher[s_start[i + 1]]
                if c < 0:
                    continue
                j = int(owner[c])
                m = int(c - t_start[j])
                if j == 0 or len(gold) > len(t_tokens[j]) - m:
                    continue  # no teacher context, or the teacher's next token cannot express the student's
                sources[r, i] = j - 1
                prefixes[r, i] = self._prefix(t_tokens[j][:m])
            teacher_rows.append(t_ids)
        width = max(1, max(len(t) for t in teacher_rows))
        pad = self.teacher.pad_token_id if self.teacher.pad_token_id is not None else 0
        ids = torch.full((rows, width), pad, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        for r, t in enumerate(teacher_rows):
            ids[r, : len(t)] = torch.tensor(t, dtype=torch.long)
            attention[r, : len(t)] = 1
        return BridgedWindows(ids, attention, sources, prefixes)

    def map(self, teacher_logits: torch.Tensor, bridged: BridgedWindows, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities over the student vocabulary, mask) for the student positions of ``rows``.

        ``teacher_logits``: (len(rows), Lt, V_teacher), the teacher's output on ``bridged.teacher_ids[rows]``.
        Masked positions hold a uniform distribution. Log-probabilities are floored at log(1e-10), so they
        are finite and usable as logits.
        """
        source, prefix = bridged.source[rows], bridged.prefix[rows]
        probs = torch.softmax(teacher_logits.float(), dim=-1)
        out = torch.zeros((*source.shape, len(self.s_surface)), dtype=probs.dtype)
        valid = source >= 0
        for pid in prefix[valid].unique().tolist():
            where = (valid & (prefix == pid)).nonzero(as_tuple=True)
            t_ids, s_ids = self._candidates[pid]
            if len(t_ids) == 0:
                continue
            p = probs[where[0], source[where]][:, t_ids]  # (positions, candidates)
            out[where] = torch.zeros((len(p), out.shape[-1]), dtype=p.dtype).index_add_(1, s_ids, p)
        mass = out.sum(-1)
        mask = valid & (mass > 0)
        out = torch.where(mask.unsqueeze(-1), out / mass.clamp_min(1e-30).unsqueeze(-1), 1.0 / out.shape[-1])
        return out.clamp_min(1e-10).log(), mask
