"""Population data from a recipe, and a pretrained target loaded from local files (no hub)."""

from __future__ import annotations

import torch

from fedfusion.config.recipe import load_recipe
from fedfusion.data.population import client_windows, data_spec, pooled_held_out, population_data, tier_list
from fedfusion.data.text import load_tokenizer
from fedfusion.fusion.plan import recipe_target
from fedfusion.fusion.submodel.plan import plan_table
from fedfusion.models.build import build_target, target_model_config
from tests.conftest import tiny_config


def test_shakespeare_population_is_seeded_and_split():
    recipe = load_recipe("quickstart")
    clients = population_data(data_spec(recipe.data_source()))
    assert len(clients) == recipe.population.num_clients == len(tier_list(recipe.population, recipe.seed))
    assert len({c.name for c in clients}) == len(clients)
    for c in clients:
        total = len(c.train) + len(c.held_out)
        assert abs(len(c.held_out) - 0.1 * total) <= 1
    other = population_data(data_spec(load_recipe("quickstart", ["seed=1"]).data_source()))
    assert [c.name for c in other] != [c.name for c in clients]
    assert len(pooled_held_out(data_spec(recipe.data_source()), 5000)) <= 5000 + len(clients)


def test_local_text_source_is_sharded_per_client(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i} of a local corpus\n" for i in range(400)))
    recipe = load_recipe("quickstart", ["data.source=text", f"data.path={path}", "population.num_clients=4",
                                        "selection.clients_per_round=2"])
    clients = population_data(data_spec(recipe.data_source()))
    assert [c.name for c in clients] == [f"shard-{i}" for i in range(4)]
    assert "".join(c.train + c.held_out for c in clients) == path.read_text()[: 4 * (len(path.read_text()) // 4)]


def test_pretrained_target_and_tokenizer_load_from_a_local_directory(tmp_path):
    tok = load_tokenizer(None)
    cfg = tiny_config()
    cfg.vocab_size = len(tok)
    torch.manual_seed(3)
    from transformers import LlamaForCausalLM

    saved = LlamaForCausalLM(cfg)
    saved.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    recipe = load_recipe("quickstart", [f"model.pretrained={tmp_path}"])
    model = build_target(recipe.model, load_tokenizer(recipe.model.pretrained), seed=0)
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)
    assert target_model_config(recipe.model).hidden_size == cfg.hidden_size
    rows = plan_table(recipe.fusion, recipe.train, recipe.population, recipe_target(recipe.model, recipe.data_source()))
    assert [r["width"] for r in rows] == [0.125, 0.25, 0.5]
    windows = client_windows(data_spec(recipe.data_source()), 0, 16, "train")  # clients tokenise with the same tokenizer
    assert windows.shape[1] == 17 and int(windows.max()) < len(tok)
