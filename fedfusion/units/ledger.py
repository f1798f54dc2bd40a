"""The server's side of a units step, priced as every ledger row is (``fedfusion.devices.energy.price_work``): its
own compute (``phases.server_flops``), its Freivalds checks (``verify.check_flops``) and its traffic, each on the
server's catalog tier; and the step's training work (the devices' units, each once, plus the server's own compute)
on a cloud GPU of the catalog, the reference the mode competes with.

The server's time also enters the step's virtual time (:func:`server_timeline`): its compute and checks
between phases, spread evenly over the step's phases, queued on its processor, and the optimizer after the last
one; its traffic passes its send and receive links, shared queues of the timeline at the same tier's rates
(``fedfusion.units.devices.server_from_catalog``): the bytes priced here are the ones the timeline queues.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfusion.devices.catalog import Device
from fedfusion.devices.energy import WorkCost, price_work


@dataclass(frozen=True)
class ServerStep:
    """One step's server work priced on ``server``, and the same training work priced on ``cloud``."""

    server: str
    cloud: str
    flops: dict[str, float]  # the server's own compute by item (``phases.server_flops``)
    verify_flops: float
    egress_bytes: int  # what the server sends: every device's downloads
    ingress_bytes: int  # what it receives: every device's uploads
    unit_flops: float  # the devices' GEMM FLOPs, each unit once (re-sends are the devices' waste, not work)
    compute: WorkCost
    verify: WorkCost
    traffic: WorkCost
    cloud_step: WorkCost

    @property
    def energy_j(self) -> float:
        """Wall joules of the server's compute, checks and traffic."""
        return self.compute.wall_j + self.verify.wall_j + self.traffic.wall_j

    @property
    def co2_g(self) -> float:
        return self.compute.co2_g + self.verify.co2_g + self.traffic.co2_g

    def row(self) -> dict[str, float | str]:
        """The metrics row's server and cloud fields (``server_flops``, ``server_energy_j`` and ``server_co2_g`` as
        fusion rounds write them)."""
        return {
            "server_device": self.server, "server_flops": sum(self.flops.values()),
            **{f"server_{item}_flops": value for item, value in self.flops.items()},
            "server_verify_flops": self.verify_flops, "server_egress_bytes": self.egress_bytes,
            "server_ingress_bytes": self.ingress_bytes, "server_compute_s": self.compute.compute_s,
            "server_verify_s": self.verify.compute_s, "server_comm_s": self.traffic.comm_s,
            "server_energy_j": self.energy_j, "server_co2_g": self.co2_g,
            "cloud_device": self.cloud, "cloud_flops": self.unit_flops + sum(self.flops.values()),
            "cloud_step_s": self.cloud_step.compute_s, "cloud_energy_j": self.cloud_step.wall_j,
            "cloud_co2_g": self.cloud_step.co2_g,
        }


def server_timeline(server: Device, flops: dict[str, float], verify_flops: float, phases: int) -> tuple[float, float]:
    """``timeline.simulate``'s ``server_gap_s`` (the server's compute but the optimizer, and its checks, spread
    over the step's ``phases``, every micro-batch's) and ``optimizer_s``, at ``server``'s speed."""
    optimizer_s = price_work(server, flops["optimizer"], 0, 0).compute_s
    between = price_work(server, sum(flops.values()) - flops["optimizer"] + verify_flops, 0, 0).compute_s
    return (between / phases if phases else 0.0), optimizer_s


def price_server(server: Device, cloud: Device, flops: dict[str, float], verify_flops: float, egress_bytes: int,
                 ingress_bytes: int, unit_flops: float) -> ServerStep:
    """Price one step's server work on ``server`` (compute, checks and traffic apart) and the step's training
    work (``unit_flops`` plus the server's compute; no checks, no transfers: the cloud holds model and data) on
    ``cloud``."""
    own = sum(flops.values())
    return ServerStep(
        server=server.name, cloud=cloud.name, flops=dict(flops), verify_flops=verify_flops, egress_bytes=egress_bytes,
        ingress_bytes=ingress_bytes, unit_flops=unit_flops, compute=price_work(server, own, 0, 0),
        verify=price_work(server, verify_flops, 0, 0),
        traffic=price_work(server, 0.0, ingress_bytes, egress_bytes),  # price_work's down: what its device receives
        cloud_step=price_work(cloud, unit_flops + own, 0, 0))
