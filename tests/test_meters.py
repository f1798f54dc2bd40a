"""Measured host energy through Zeus, on a faked Zeus monitor: the meter, the reply keys, the strategy's reading
and the clients.jsonl row, wired end to end (any broken link fails the last test)."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfusion.devices import meters
from fedfusion.devices.meters import WIRE_PREFIX, HostMeter, meter_joules, read_measured
from fedfusion.train.loop import TrainResult
from tests.test_strategy import FakeGrid, make_strategy, task_identity  # noqa: F401  (task_identity: a fixture)

NVIDIAGPUs = type("NVIDIAGPUs", (), {})  # Zeus names its GPU backends by class: the meter reads the name
AppleSilicon = type("AppleSilicon", (), {})
Jetson = type("Jetson", (), {})


class FakeMonitor:
    """Stands in for ``zeus.monitor.ZeusMonitor``: windows by key, one Measurement-shaped reading per window."""

    def __init__(self, reading: SimpleNamespace, gpus: object = None, soc: object = None) -> None:
        self.reading, self.gpus, self.soc = reading, gpus or NVIDIAGPUs(), soc or object()
        self.open: set[str] = set()
        self.cancelled: list[str] = []

    def begin_window(self, key: str) -> None:
        assert key not in self.open
        self.open.add(key)

    def end_window(self, key: str, cancel: bool = False) -> SimpleNamespace:
        self.open.remove(key)
        if cancel:
            self.cancelled.append(key)
        return self.reading


def reading(gpu=None, cpu=None, dram=None, soc=None) -> SimpleNamespace:
    """A reading shaped as zeus.monitor.energy.Measurement (joules per device index; the SoC's own dataclass)."""
    return SimpleNamespace(time=1.0, gpu_energy=gpu or {}, cpu_energy=cpu, dram_energy=dram, soc_energy=soc)


@pytest.fixture
def fake(monkeypatch) -> FakeMonitor:
    monitor = FakeMonitor(reading(gpu={0: 120.0}, cpu={0: 30.0, 1: 10.0}, dram={0: 5.0}))
    asked = []
    monkeypatch.setattr(meters, "make_monitor", lambda gpu: asked.append(gpu) or monitor)
    monitor.asked = asked
    return monitor


def test_the_meter_reports_each_meter_zeus_read(fake):
    with HostMeter(gpu=0) as meter:
        assert fake.open  # the window is open while the work runs
    assert not fake.open and fake.asked == [0]
    assert meter.joules == {"nvml": 120.0, "rapl": 40.0, "rapl-dram": 5.0}
    assert meter.metrics() == {"measured-j-nvml": 120.0, "measured-j-rapl": 40.0, "measured-j-rapl-dram": 5.0}


def test_work_that_fails_cancels_its_window_and_reports_nothing(fake):
    with pytest.raises(RuntimeError), HostMeter() as meter:
        raise RuntimeError("training crashed")
    assert len(fake.cancelled) == 1 and not fake.open and meter.metrics() == {}


def test_a_meter_that_fails_to_read_leaves_the_training_alone(monkeypatch):
    class Broken(FakeMonitor):
        def end_window(self, key: str, cancel: bool = False):
            raise RuntimeError("NVML: GPU is lost")

    monkeypatch.setattr(meters, "make_monitor", lambda gpu: Broken(reading()))
    with HostMeter(gpu=0) as meter:
        done = True
    assert done and meter.metrics() == {}


def test_without_zeus_nothing_is_measured(monkeypatch):
    monkeypatch.setattr(meters, "zeus_installed", lambda: False)
    with HostMeter() as meter:
        pass
    assert meter.joules == {} and meter.metrics() == {}


def test_soc_readings_add_up_without_counting_a_part_twice():
    apple = SimpleNamespace(cpu_total_mj=3000, efficiency_cores_mj=[500, 500], performance_cores_mj=[1000],
                            dram_mj=400, gpu_mj=2000, gpu_sram_mj=None, ane_mj=600)
    assert meter_joules(FakeMonitor(reading(), soc=AppleSilicon()), reading(soc=apple)) == {"apple": 6.0}
    jetson = SimpleNamespace(cpu_energy_mj=1000.0, gpu_energy_mj=2500.0, total_energy_mj=4200.0)
    assert meter_joules(FakeMonitor(reading(), soc=Jetson()), reading(soc=jetson)) == {"jetson": 4.2}


def test_a_reply_s_readings_become_one_labelled_figure():
    assert read_measured({"num-examples": 3}) is None
    assert read_measured({"measured-j-rapl": 40.0, "measured-j-nvml": 2.5, "train_s": 1.0}) == (42.5, "nvml+rapl")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="measured-j-rapl"):
            read_measured({"measured-j-rapl": bad})


@pytest.mark.slow  # imports Zeus (pandas, scikit-learn): seconds
def test_real_zeus_reads_as_the_fake_does():
    """The fake's shape is Zeus's: a real ``Measurement`` reads the same, and a real monitor on this host runs a
    window through :class:`HostMeter` (skipped where Zeus is not installed)."""
    energy = pytest.importorskip("zeus.monitor.energy")
    real = energy.Measurement(time=1.0, gpu_energy={0: 120.0}, cpu_energy={0: 30.0, 1: 10.0}, dram_energy={0: 5.0})
    assert meter_joules(FakeMonitor(reading()), real) == {"nvml": 120.0, "rapl": 40.0, "rapl-dram": 5.0}
    assert "cancel" in inspect.signature(energy.ZeusMonitor.end_window).parameters
    monitor = meters.make_monitor(None)
    assert isinstance(monitor, energy.ZeusMonitor)
    monitor.begin_window("probe")
    meters_here = set(meter_joules(monitor, monitor.end_window("probe")))
    with HostMeter() as meter:
        sum(range(1000))
    assert set(meter.joules) == meters_here  # whatever meters this host has (none: both empty)


def test_measured_joules_reach_clients_jsonl_next_to_the_priced_energy(fake, tmp_path):
    """Client role (trained_reply under the meter) -> reply metrics -> strategy -> the recorder's ledger row ->
    clients.jsonl: each row carries the measured joules and their meters, and the priced energy beside them."""
    from fedfusion.clients.submodel import trained_reply
    from transformers import LlamaConfig

    from fedfusion.analysis.report import read_jsonl
    from fedfusion.config.recipe import load_recipe
    from fedfusion.devices.catalog import load_catalog
    from fedfusion.models.build import model_from_state
    from fedfusion.run.federation import ledger_row
    from fedfusion.run.run_dir import RunDir

    strategy, state = make_strategy()
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}),
                                         FakeGrid({11: "phone", 12: "desktop", 13: "phone"})))
    replies = []
    for m in msgs:
        spec = json.loads(m.content["config"]["model-config"])
        model = model_from_state(LlamaConfig.from_dict(spec), m.content["arrays"].to_torch_state_dict())
        new, metrics = trained_reply(model, torch.zeros(3, 2), (False, 0.0),
                                     lambda: TrainResult((1.0,), 0.0, 0.1))
        replies.append(Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord(metrics)}), reply_to=m))
    assert fake.asked == [None, None, None]  # CPU training: no GPU is metered
    strategy.aggregate_train(1, replies)
    run = RunDir(tmp_path / "run", load_recipe("quickstart"))
    catalog = load_catalog()
    run.log_clients([ledger_row(1, row, catalog) for row in strategy.run.round.rows.values()])
    rows = read_jsonl(run.path / "clients.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["status"] == "ok"
        assert row["measured_j"] == 165.0 and row["measured_source"] == "nvml+rapl+rapl-dram"
        assert row["energy_j"] > 0 and row["energy_j"] != row["measured_j"]  # the priced figure, kept apart
    assert not any(k.startswith(WIRE_PREFIX) for k in rows[0])
