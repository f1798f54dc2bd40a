"""A text file cut into equal shards of characters, one a client (``data.source: text``), each read when asked.

A population of 100,000 clients over a 150 MB file would otherwise hold the whole text, its 100,000 shards and their
train / held-out halves in every process that reads one of them (the server and each simulation actor). Where the
file's characters are its bytes (plain ASCII with no carriage return, which ``read_text`` would translate) a shard
is read from the file at its offset and nothing is held; the file must then stay as it was when sized (its size and
modification time, which the run's data spec records too, are checked at each read: a changed file is an error,
not another shard). Any other file is read whole once and sliced. Either way shard ``i`` is ``text[i * size:(i + 1) * size]``
with ``size = len(text) // count`` (the remainder dropped), ``text`` as :func:`fedfusion.data.text.load_text_file`
reads it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from fedfusion.data.text import load_text_file

CHUNK = 1 << 24  # bytes read at a time while sizing a file


def plain_size(path: str | Path) -> int | None:
    """The length of a ``.txt`` file whose characters are its bytes (ASCII, no carriage return), else None."""
    if Path(path).suffix != ".txt":
        return None
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if not chunk.isascii() or b"\r" in chunk:
                return None
            size += len(chunk)
    return size


def version(stat: os.stat_result) -> tuple[int, int]:
    """A file's size and modification time (ns): what tells a changed file."""
    return stat.st_size, stat.st_mtime_ns


@dataclass(frozen=True)
class Shards(Sequence[str]):
    """``length`` shards of ``size`` characters: read from ``path`` at their offsets (the file as ``stamp``, its
    :func:`version`, says), or sliced from ``text``."""

    length: int
    size: int
    path: str | None = None
    stamp: tuple[int, int] | None = None
    text: str | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.length))]
        if not -self.length <= i < self.length:
            raise IndexError(f"shard {i} of {self.length}")
        start = (i % self.length) * self.size
        if self.text is not None:
            return self.text[start:start + self.size]
        assert self.path is not None
        with open(self.path, "rb") as f:
            if version(os.fstat(f.fileno())) != self.stamp:
                raise ValueError(f"{self.path} changed since the population's shards were cut from it: rerun with the "
                                 "file as it is now (a new data spec), or put the old file back")
            f.seek(start)
            return f.read(self.size).decode("ascii")


def text_shards(path: str | Path, count: int) -> Shards:
    """``path`` cut into ``count`` equal shards (see the module): read on demand where the file allows it."""
    if count < 1:
        raise ValueError(f"text shards: count must be positive, got {count}")
    path = Path(path).resolve()  # a later chdir reads the same file
    stamp = version(path.stat())
    size = plain_size(path)
    if size is None:
        text = load_text_file(path)
        return Shards(count, len(text) // count, text=text)
    if version(path.stat()) != stamp:
        raise ValueError(f"{path} changed while it was being read: try again once nothing writes to it")
    return Shards(count, size // count, path=str(path), stamp=stamp)
