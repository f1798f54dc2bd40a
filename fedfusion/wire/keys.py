"""Record and metric keys that more than one side of a message reads or writes, each spelled once."""

from __future__ import annotations

# a reply's MetricRecord: how many examples the client trained or evaluated on (Flower's FedAvg weighs by it too)
NUM_EXAMPLES = "num-examples"
# a reply's MetricRecord from a real device (a phone behind a gateway): its own seconds per training step; its
# train_s is then the device's own training time, which the ledger prices instead of the catalog's speed
DEVICE_STEP_S = "device_step_s"
# wire arrays a LoRA client applies, never trains (FLoRA's merged update): the DP mods leave them alone
FROZEN_SUFFIXES = (".merged_A", ".merged_B", ".merged_W")
# the key prefix of the frozen target in a full-forward payload (the window's keys have none); a device keeps
# these entries as they travelled (fedfusion.wire.quantize.decode's ``keep``)
FROZEN = "frozen/"
