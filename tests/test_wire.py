"""The typed message specs: every recipe field the server writes is the key a client reads."""

from __future__ import annotations

import pytest

from fedfusion.recipe import FaultConfig, TrainConfig
from fedfusion.wire import FAULT_KEYS, fault_spec, read_faults, read_train, train_spec


def test_faults_round_trip_every_field():
    faults = FaultConfig(crash_prob=0.1, straggler_prob=0.2, straggler_delay_s=3.0, corrupt_prob=0.4)
    assert read_faults(fault_spec(faults)) == faults
    assert read_faults({"seed": 1}) == FaultConfig()  # a spec without fault keys injects none


def test_a_spec_with_some_fault_keys_is_refused():
    spec = fault_spec(FaultConfig(crash_prob=1.0))
    spec.pop(FAULT_KEYS["corrupt_prob"])
    with pytest.raises(ValueError, match="fault-corrupt-prob"):
        read_faults(spec)


def test_train_settings_round_trip_and_a_missing_key_is_named():
    train = TrainConfig(local_steps=7, lr=0.5, batch_size=3, seq_len=9, weight_decay=0.1, optimizer="sgd")
    spec = {**train_spec(train), "seed": 4}
    assert read_train(spec) == dict(steps=7, lr=0.5, batch_size=3, weight_decay=0.1, optimizer="sgd", seed=4)
    assert spec["seq-len"] == 9
    spec.pop("optimizer")
    with pytest.raises(KeyError, match="train.optimizer"):
        read_train(spec)
