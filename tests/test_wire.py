"""The typed message specs: every field the server writes is the key a client reads, and a received spec that
lacks a key or carries a mistyped one is refused naming it."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from flwr.app import ConfigRecord
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedfusion.config.choices import LORA_METHODS as METHODS
from fedfusion.config.choices import POLICIES
from fedfusion.config.sections import FaultConfig, PrivacyConfig, TrainConfig
from fedfusion.fusion.distill.spec import FamilySpec
from fedfusion.fusion.generative.spec import GenerativeSpec
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
from fedfusion.wire.specs import (
    ROLES,
    Caps,
    ClientSpec,
    FaultSpec,
    ModelSpec,
    OrderedSpec,
    PopulationSpec,
    PrivacySpec,
    RoleSpec,
    RoundSpec,
    SliceSpec,
    Spec,
    SpecError,
    TrainSpec,
    UnitsSpec,
    WindowSpec,
    WireSpec,
    merge,
    read_train,
    spec_types,
)

# one instance of every spec, each field away from its default, so a field that does not travel shows
EXAMPLES: list[Spec] = [
    ClientSpec("{\"source\": \"shakespeare\"}", 48, 2),
    RoundSpec(3, 17),
    RoleSpec("lora"),
    TrainSpec(7, 0.5, 3, 0.1, "sgd"),
    FaultSpec(0.1, 0.2, 3.0, 0.4),
    PrivacySpec("local", 0.5, 2.0, 1e-4),
    ModelSpec({"model_type": "llama", "hidden_size": 64, "rope_scaling": None}),
    SliceSpec(0.25, "ordered", ("heads", "mlp")),
    WindowSpec({"attn_units": [[2, 3]], "neurons": [[0, 1], [6, 7]], "hidden": [[0, 7]], "layers": [[0, 1]]}, False),
    OrderedSpec((0.125, 0.25), True),
    FamilySpec("tiny-gpt2", "{\"model\": {}}"),
    GenerativeSpec(0.5, 4, 0.8, 8, "node", True),
    LoRABaseSpec("smollm2", "bfloat16", ("q_proj", "v_proj"), 0.05),
    QuantizeSpec(4),
    AdapterSpec("hetlora", 8, 16.0),
    WireSpec("int4", True),
    PopulationSpec({"phone": 0.5, "desktop": 0.5}, 32, 1),
    Caps("phone", 5, 120),
    UnitsSpec(2.5),
]


def test_every_spec_type_has_an_example():
    assert sorted(type(s).__name__ for s in EXAMPLES) == sorted(t.__name__ for t in spec_types())


@pytest.mark.parametrize("spec", EXAMPLES, ids=lambda s: type(s).__name__)
def test_a_spec_round_trips_through_a_config_record(spec):
    record = ConfigRecord(spec.to_config())  # what Flower carries: scalars and text only
    assert set(record) == set(spec.keys())
    assert type(spec).from_config(record) == spec


@pytest.mark.parametrize("spec", EXAMPLES, ids=lambda s: type(s).__name__)
def test_a_spec_missing_a_key_is_refused_naming_the_key(spec):
    for key in spec.keys():
        config = spec.to_config()
        config.pop(key)
        with pytest.raises(SpecError, match=f"lacks '{key}'"):
            type(spec).from_config(config)


def test_a_mistyped_value_is_refused_naming_the_key():
    config = TrainSpec(7, 0.5, 3, 0.1, "sgd").to_config()
    with pytest.raises(SpecError, match="'local-steps': expected int, got str"):
        TrainSpec.from_config({**config, "local-steps": "7"})
    with pytest.raises(SpecError, match="'batch-size': expected int, got bool"):
        TrainSpec.from_config({**config, "batch-size": True})
    assert TrainSpec.from_config({**config, "lr": 1}).lr == 1.0  # an int is a float
    with pytest.raises(SpecError, match="'axes': cannot decode"):
        SliceSpec.from_config({**SliceSpec(0.5, "static", None).to_config(), "axes": "[heads"})


def test_values_are_checked_against_the_owning_modules_constants():
    for policy in POLICIES:
        SliceSpec(0.5, policy, None)
    with pytest.raises(SpecError, match="'policy': 'fedrolex' is not one of"):
        SliceSpec.from_config({**SliceSpec(0.5, "static", None).to_config(), "policy": "fedrolex"})
    for method in METHODS:
        AdapterSpec(method, 4, 8.0)
    with pytest.raises(SpecError, match="'role': 'teacher' is not one of " + ", ".join(ROLES)):
        RoleSpec("teacher")
    with pytest.raises(SpecError, match="'quantize': 3"):
        QuantizeSpec(3)
    with pytest.raises(SpecError, match="'model-config'"):
        ModelSpec({"hidden_size": 64})
    with pytest.raises(SpecError, match="'device-state': 'phone' is not one of node, server"):
        GenerativeSpec.from_config({**GenerativeSpec(0.5, 4, 0.8, 0, "node", False).to_config(), "device-state": "phone"})
    with pytest.raises(SpecError, match="'kept': only a node that keeps its model"):
        GenerativeSpec(0.5, 4, 0.8, 0, "server", True)


def test_keys_follow_field_names_and_the_keys_other_libraries_read():
    assert TrainSpec.key("local_steps") == "local-steps" and FaultSpec.key("crash_prob") == "fault-crash-prob"
    assert OrderedSpec.keys() == ("ordered-fractions", "ordered-distill")
    assert PrivacySpec.key("clipping_norm") == KEY_CLIPPING_NORM  # Flower's fixedclipping_mod reads it
    with pytest.raises(AttributeError, match="no field 'steps'"):
        TrainSpec.key("steps")
    model = {"model_type": "llama", "hidden_size": 64}
    assert ModelSpec(model).to_config() == {"model-config": json.dumps(model)}  # the JSON a device gateway reads
    assert SliceSpec(0.5, "static", None).to_config()["axes"] == "null"


def test_the_recipe_sections_become_specs_field_by_field():
    train = TrainConfig(local_steps=7, lr=0.5, batch_size=3, seq_len=9, weight_decay=0.1, optimizer="sgd")
    # seq_len travels in ClientSpec; the lr schedule stays on the server, which sends each round's lr as ``lr``, and
    # so does eval_every (which rounds the server scores), and max_epochs (the server sends a capped client its own
    # local_steps)
    server_only = {"seq_len", "lr_schedule", "lr_final", "eval_every", "max_epochs"}
    assert {f.name for f in fields(TrainSpec)} | server_only == {f.name for f in fields(TrainConfig)}
    assert read_train({**TrainSpec.from_recipe(train).to_config(), **RoundSpec(1, 4).to_config()}) == dict(
        steps=7, lr=0.5, batch_size=3, weight_decay=0.1, optimizer="sgd", seed=4)
    faults = FaultConfig(crash_prob=0.1, straggler_prob=0.2, straggler_delay_s=3.0, corrupt_prob=0.4)
    assert FaultSpec.from_recipe(faults) == FaultSpec(**vars(faults))
    privacy = PrivacyConfig(mode="clip", clipping_norm=0.5)
    assert PrivacySpec.from_recipe(privacy) == PrivacySpec("clip", 0.5, privacy.epsilon, privacy.delta)


def test_faults_are_all_or_nothing():
    assert FaultSpec.read({"seed": 1}) == FaultSpec()  # a message without fault keys injects none
    spec = FaultSpec(crash_prob=1.0).to_config()
    spec.pop("fault-corrupt-prob")
    with pytest.raises(SpecError, match="fault-corrupt-prob"):
        FaultSpec.read(spec)


def test_merge_refuses_two_specs_writing_one_key():
    assert merge(RoleSpec("submodel"), RoundSpec(1, 2)) == {"role": "submodel", "server-round": 1, "seed": 2}
    with pytest.raises(ValueError, match=r"RoundSpec writes keys another spec wrote: \['seed', 'server-round'\]"):
        merge(PopulationSpec({}, 1, 0), RoundSpec(1, 2), RoundSpec(1, 3))
