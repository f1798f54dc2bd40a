"""Units mode: the whole target trained exactly through sub-matrix units on devices (after Cleave,
arXiv 2512.22142). The server keeps the model, the data, attention cores, norms, embeddings, the loss and the
optimizer; every linear layer's GEMMs (forward ``X W^T``, input gradient ``dY W``, weight gradient ``dY^T X``)
are cut into tiles sized to each device and computed there. No Flower here; this is the core the Flower layer
wraps.

Modules: ``devices`` (``UnitDevice``: memory, FLOP/s, link rates, latency; ``from_catalog``; ``UnitServer``: the
server's links), ``plan`` (cost model and planner), ``messages`` (wire format, the device side
``compute_units``/``DeviceRuntime``, the byte formula),
``verify`` (Freivalds' check, strikes), ``engine`` (``UnitEngine``: plan, dispatch, verify, re-dispatch,
assemble), ``accumulate`` (weight-gradient tiles summed on the devices over a step's micro-batches), ``hooks``
(``install`` on a Hugging Face Llama), ``phases`` (a step's phases from the shape alone), ``timeline`` (virtual
step time under the devices' and the server's links, micro-batches and churn, and its lower bound), ``shaper`` (the
same links emulated for real: when a message is through, for the Flower transport to wait on), ``ledger``
(the server's compute, checks and traffic priced with ``price_work``, and the same step on a cloud GPU),
``workers`` (emulated faulty devices), ``baselines`` (a pipeline + data-parallel schedule on the same
devices and links, and one GPU: what the mode's step is set against).

README -- the API the Flower layer calls
-----------------------------------------

Server side (a ServerApp mode)::

    engine = UnitEngine(devices=[from_catalog(tier, name=str(node_id)) for ...], transport=flower_transport,
                        accumulate=len(micro_batches))   # devices sum weight gradients over the micro-batches
    handle = install(model, engine, mode="all")      # or "mlp"; the parameters stay the same objects
    for micro, batch in enumerate(micro_batches):
        engine.chain = micro                         # required with accumulate: names the micro-batch's share
        model(**batch).loss.backward()               # every linear GEMM goes through engine.phase(...)
    optimizer.step()                                 # weights' versions change: device caches go stale by key

With ``accumulate`` > 1 a weight's gradient reaches ``.grad`` only from the step's last micro-batch to reach that
layer (the devices' sums); that micro-batch's phase waits for the others' products of that weight to be kept.

``transport(payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]`` is the one
seam to Flower. Per phase round the engine hands it one payload per device (device index -> bytes) and each
device's deadline in seconds (``deadline_factor`` x its predicted time); the transport pushes one message per
device (``Grid.push_messages``; content e.g. ``ConfigRecord({"units": payload})`` or the arrays as an
``ArrayRecord``, ``message_type="train.units"``, a TTL of the deadline), pulls replies on its own short loop
(not ``send_and_receive``'s 0.1 s / 3 s sleeps) and returns per device the reply's bytes, ``None`` when none
came by the deadline (the device is taken offline and its units re-dispatched; a later reply is dropped; between
steps ``UnitEngine.rejoin`` lets it take units again, its weights sent anew) or
``b""`` for an error reply (e.g. the device lost its weight cache: no strike, its units go elsewhere and its
weights are sent in full next time). Everything else -- which device gets which tile, verification, strikes,
re-dispatch, first-valid-wins, assembly -- stays in the engine. To overlap micro-batches, call the engine from one
thread per micro-batch (``engine.chain`` is per thread; ``fedfusion.run.units.train_step`` does): a thread's
phase releases the engine's lock while its transport waits, so the other micro-batches' messages are queued at the
SuperLink meanwhile (Flower's ``Grid.push_messages`` keeps them all in flight) and the server's time between phases
is hidden; whether a device also overlaps them depends on how many messages it holds at once (``timeline``'s
``lanes``).

A message to a device (``messages.encode_units``): a 4-byte header length, a JSON header
``{"phase": p, "units": [[uid, a_key, a_transposed, b_key, b_transposed], ...],
"arrays": [[key, dtype, shape], ...]}`` and the raw bytes of those arrays (a weight-gradient unit adds
``sum_key, micro, emit``: the device adds its product to a running sum and replies the sum only when ``emit``).
Keys name operand blocks in base coordinates (``X[0:256,0:128]``, weights ``W12@3[0:512,0:128]`` with their
version); a block used by several units travels once and weight blocks the device already holds are left out. The device computes
``op(blocks[a_key]) @ op(blocks[b_key])`` per unit.

A reply (``messages.encode_reply``): the same framing, header ``{"phase": p, "arrays": [[uid, dtype, shape],
...]}`` (and ``"kept": n``, the products kept in running sums) and one result tile per unit that returns one, in
the operands' dtype.

Device side (a ClientApp handler): ``DeviceRuntime()(payload) -> reply`` -- keep one ``DeviceRuntime`` per node
(its ``cache`` dict of weight blocks and its running ``sums`` belong in ``context.state`` between messages;
without them, answer with an error so the server resends the weights and recomputes the sums). It uses torch on
the CPU; put the tensors on the device's accelerator where it has one.
"""

from fedfusion.units.devices import UnitDevice, from_catalog
from fedfusion.units.engine import PhaseRecord, Transport, UnitEngine, in_process
from fedfusion.units.hooks import install
from fedfusion.units.messages import DeviceRuntime, Gemm, Operand, compute_units
from fedfusion.units.plan import CostModel, GemmShape, PhasePlan, Tile, plan_phase
from fedfusion.units.verify import Freivalds, Strikes

__all__ = ["CostModel", "DeviceRuntime", "Freivalds", "Gemm", "GemmShape", "Operand", "PhasePlan", "PhaseRecord",
           "Strikes", "Tile", "Transport", "UnitDevice", "UnitEngine", "compute_units", "from_catalog", "in_process",
           "install", "plan_phase"]
