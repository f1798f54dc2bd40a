"""The reference device: a process that takes training tasks from a gateway and trains them only through the
ExecuTorch runtime, as the phone apps must (``fedfusion device --gateway URL --token T``).

Per task: fetch the program once (cached by id), the round's weights, copy them into the program, run the task's
local steps with the client-code optimizer, send the trained weights and metrics back. A full-forward window's
frozen target is fetched only when the task names a hash other than the one its program holds, checked against that
hash, and written as it arrived into the program's data file, the device's one copy of it (the program dequantises
it), until the next change. Its local data stands in for a
phone's own: the partition the task names, read as a simulated client reads it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from fedfusion.phone.gateway import call, frozen_hash, pack, unpack
from fedfusion.phone.program import DeviceProgram
from fedfusion.phone.runtime import ProgramRunner, train_program
from fedfusion.wire.keys import DEVICE_STEP_S, NUM_EXAMPLES

if TYPE_CHECKING:
    import torch

    from fedfusion.train.instruct import InstructData


@lru_cache(maxsize=4)
def _pairs(data_spec: str, partition: int, base: str, seq_len: int) -> InstructData:
    """This device's training pairs, encoded with the base's tokenizer (a phone's app ships that tokenizer)."""
    from fedfusion.data.instruct import instruct_clients
    from fedfusion.models.pretrained import load_base_tokenizer
    from fedfusion.train.instruct import encode_pairs

    return encode_pairs(load_base_tokenizer(base), instruct_clients(data_spec)[partition].train, seq_len)


class FrozenMismatch(ValueError):
    """The frozen target a gateway sent is not the one its task names (corrupted, or swapped on the way)."""


class DeviceRefused(RuntimeError):
    """The gateway refused this device (unknown or revoked token)."""


def _ok(status: int, body: bytes, what: str) -> bytes:
    if status in (401, 403):
        raise DeviceRefused(f"{what}: gateway refused this device ({status}): {body.decode(errors='replace')}")
    if status != 200:
        raise RuntimeError(f"{what}: gateway answered {status}: {body.decode(errors='replace')[:300]}")
    return body


class ReferenceDevice:
    """One device's session with a gateway."""

    def __init__(self, gateway: str, token: str, threads: int = 1) -> None:
        self.gateway, self.token, self.threads = gateway.rstrip("/"), token, threads
        self.runners: dict[str, ProgramRunner] = {}
        self.fetched: list[str] = []  # the frozen targets' hashes fetched, in order (each one a download)

    def get(self, path: str) -> tuple[int, bytes]:
        return call(self.gateway + path, "GET", self.token)

    def register(self) -> str:
        body = _ok(*call(self.gateway + "/v1/register", "POST", self.token, b""), "register")
        return str(json.loads(body)["device"])

    def runner(self, program: str) -> ProgramRunner:
        if program not in self.runners:
            files = {name: _ok(*self.get(f"/v1/programs/{program}/{name}"), f"program {name}")
                     for name in ("program.pte", "weights.ptd", "manifest.json")}
            self.runners[program] = ProgramRunner(DeviceProgram(files["program.pte"], files["weights.ptd"],
                                                                json.loads(files["manifest.json"])))
        return self.runners[program]

    def frozen_target(self, task: dict, held: str = "") -> dict[str, torch.Tensor] | None:
        """The frozen target ``task`` names by hash, as it travelled: None if it is ``held`` (the hash of the one
        the program holds: not fetched again), else fetched and checked against the hash (:class:`FrozenMismatch`
        if it differs: nothing of it is kept). The caller writes it into its program's data file, which keeps the
        one copy; this device then holds only the hash."""
        want = str(task["frozen"])
        if want == held:
            return None
        body = _ok(*self.get(f"/v1/tasks/{task['task']}/frozen"), "frozen target")
        self.fetched.append(want)
        got = frozen_hash(body)
        if got != want:
            raise FrozenMismatch(f"the frozen target received hashes to {got[:16]}, the task names {want[:16]}: "
                                 "refused (corrupted or swapped on the way)")
        received, _ = unpack(body)
        return received

    def report(self, task: str, reason: str) -> None:
        """Tell the gateway this device could not train ``task`` (so its node answers at once, not at the
        deadline); a gateway that does not take it (the task already dropped, or gone) is left as it is."""
        try:
            call(f"{self.gateway}/v1/tasks/{task}/error", "POST", self.token, json.dumps({"error": reason}).encode())
        except OSError:
            pass

    def run_task(self, task: dict) -> dict:
        """Train one task through the runtime and send the result; returns the metrics sent."""
        import torch

        from fedfusion.data.population import client_windows, windows_spec
        from fedfusion.fusion.lora.spec import LoRABaseSpec
        from fedfusion.wire.specs import ClientSpec, PrivacySpec, read_train

        torch.set_num_threads(self.threads)
        spec = task["spec"]
        runner = self.runner(str(task["program"]))
        weights, _ = unpack(_ok(*self.get(f"/v1/tasks/{task['task']}/weights"), "weights"))
        if "window" in runner.manifest:  # the round's window positions are inputs; its frozen target is in the data file
            from fedfusion.phone.window import window_frozen, window_round
            from fedfusion.wire.specs import WindowSpec

            if "frozen" not in task:
                raise ValueError("a full-forward window's task names its frozen target's hash; this one names none")
            frozen = self.frozen_target(task, runner.frozen_id)
            if frozen is not None:
                try:
                    runner.set_frozen(window_frozen(runner.manifest, frozen), str(task["frozen"]))
                except BaseException:
                    del self.runners[str(task["program"])]  # no program loaded now: the next task loads it afresh
                    raise
                del frozen  # the program's data file holds it now
            weights, inputs = window_round(runner.manifest, weights, WindowSpec.from_config(spec))
            runner.hold(inputs)
        runner.load(weights)
        client = ClientSpec.from_config(spec)
        if "adapter" in runner.manifest and windows_spec(client.data_spec):
            raise RuntimeError("a phone's LoRA program trains instruction pairs (their response tokens); this task's "
                               "data is a population's token windows (data.source=facts)")
        if "adapter" in runner.manifest:  # a LoRA adapter's program: this device's instruction pairs
            data: torch.Tensor | InstructData = _pairs(client.data_spec, int(spec["partition"]),
                                                       LoRABaseSpec.from_config(spec).base, client.seq_len)
        else:
            data = client_windows(client.data_spec, int(spec["partition"]), client.seq_len, "train")
        privacy = PrivacySpec.from_config_if_any(spec)
        if privacy is not None and privacy.mode == "dp_sgd":  # the program's step is fixed: no per-example clipping
            raise RuntimeError("privacy.mode=dp_sgd: a phone's training program has no DP-SGD step; this device "
                               "cannot train privately")
        stats = train_program(runner, data, **read_train(spec))
        metrics = {NUM_EXAMPLES: len(data), "train_loss": stats.loss, "train_s": stats.seconds,
                   "train_tokens": stats.tokens, DEVICE_STEP_S: stats.seconds / max(1, len(stats.losses))}
        _ok(*call(f"{self.gateway}/v1/tasks/{task['task']}/result", "POST", self.token,
                  pack(runner.weights(), {"metrics": metrics})), "result")
        return metrics

    def serve(self, tasks: int | None = None, poll_s: float = 1.0, idle_s: float | None = None,
              echo: Callable[[str], None] = print) -> int:
        """Register, then take and train tasks until ``tasks`` are done or nothing came for ``idle_s`` seconds
        (None: forever). A gateway that stops answering (restarted, or gone) counts as idle time: said once, then
        polled again every ``poll_s``, as a phone app keeps trying; when it answers again the device registers again
        (a restarted gateway knows no registrations). Returns the number of tasks trained."""
        echo(f"registered with {self.gateway} as {self.register()}")
        done, idle_since, lost = 0, time.monotonic(), False
        while tasks is None or done < tasks:
            try:
                if lost:  # a restarted gateway knows no registrations: register again first
                    echo(f"gateway {self.gateway} answers again; registered as {self.register()}")
                    lost = False
                status, body = self.get("/v1/task")
            except OSError as exc:  # connection refused or reset, a timeout (urllib's URLError is an OSError)
                if not lost:
                    echo(f"gateway {self.gateway} unreachable ({exc}); trying again every {poll_s:g} s")
                status, body, lost = 204, b"", True
            if status == 204:
                if idle_s is not None and time.monotonic() - idle_since > idle_s:
                    break
                time.sleep(poll_s)
                continue
            task = json.loads(_ok(status, body, "task"))
            fetched = len(self.fetched)
            try:
                metrics = self.run_task(task)
            except DeviceRefused:
                raise
            except Exception as exc:  # a task it cannot train, or 409/a gateway gone: the device keeps serving
                echo(f"task {task['task']}: {type(exc).__name__}: {exc}")
                self.report(str(task["task"]), f"{type(exc).__name__}: {exc}")
                continue
            done, idle_since = done + 1, time.monotonic()
            frozen = ("" if "frozen" not in task else ", frozen target fetched" if len(self.fetched) > fetched
                      else ", frozen target held")
            echo(f"task {task['task']} (program {task['program']}): loss {metrics['train_loss']:.4f}, "
                 f"{metrics[DEVICE_STEP_S] * 1000:.0f} ms/step{frozen}")
        return done
