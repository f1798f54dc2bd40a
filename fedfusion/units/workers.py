"""Emulated device behaviours for tests and benchmarks: honest, wrong results, gone silent."""

from __future__ import annotations

import torch

from fedfusion.units.messages import DeviceRuntime, decode_kept, decode_reply, emitting, encode_reply


class Corrupt:
    """Computes honestly, then adds ``scale * max|C|`` to one random entry of a tile with probability ``rate``
    (``sums_only``: only the running sums it emits, its other tiles honest)."""

    def __init__(self, rate: float = 1.0, scale: float = 1e-2, seed: int = 0, sums_only: bool = False) -> None:
        self.rate, self.scale, self.sums_only = rate, scale, sums_only
        self.gen = torch.Generator().manual_seed(seed)
        self.corrupted = 0
        self.runtime = DeviceRuntime()

    def __call__(self, payload: bytes) -> bytes:
        header_phase = 0
        results = []
        reply = self.runtime(payload)
        targets = emitting(payload) if self.sums_only else None
        for uid, c in decode_reply(reply).items():
            if targets is not None and uid not in targets:
                results.append((uid, c))
                continue
            if torch.rand((), generator=self.gen).item() < self.rate and c.numel():
                flat = c.reshape(-1)
                i = int(torch.randint(0, flat.numel(), (), generator=self.gen))
                flat[i] += self.scale * (float(flat.abs().max()) + 1.0)
                self.corrupted += 1
            results.append((uid, c))
        return encode_reply(header_phase, results, decode_kept(reply))


class Away:
    """Answers ``after`` messages, misses the next ``missed`` (each one past its deadline: the engine takes the device
    offline), then answers again with an empty runtime (a device that left, restarted and came back: its weight
    cache and running sums are gone)."""

    def __init__(self, after: int = 0, missed: int = 1) -> None:
        self.after, self.missed = after, missed
        self.runtime = DeviceRuntime()

    def leave(self, missed: int = 1) -> None:
        """Miss the next ``missed`` messages from now on, then come back restarted (churn, drawn by the caller)."""
        self.after, self.missed = 0, missed

    def __call__(self, payload: bytes) -> bytes | None:
        if self.after > 0:
            self.after -= 1
            return self.runtime(payload)
        if self.missed > 0:
            self.missed -= 1
            if self.missed == 0:
                self.runtime = DeviceRuntime()  # back, restarted
            return None
        return self.runtime(payload)


class DiesAfter:
    """Answers ``messages`` messages honestly, then never again (a device that left mid-step)."""

    def __init__(self, messages: int = 0) -> None:
        self.left = messages
        self.runtime = DeviceRuntime()

    def __call__(self, payload: bytes) -> bytes | None:
        if self.left <= 0:
            return None
        self.left -= 1
        return self.runtime(payload)
