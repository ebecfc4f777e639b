"""config.json fields a user's checkpoint leaves out (or sets otherwise than our fixtures), read
as transformers reads them: the RoPE context of YaRN / Llama 3 / LongRoPE scaling and the
sliding windows each family defaults. tests/fixtures/make_hf_default_fixtures.py records what
transformers resolves for each case, and its logits where they show the difference."""

import copy
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps.models import load_hf_checkpoint
from rlax_ps.models.hf import config_from_hf
from hf_fixtures import FIXTURES, forward, reference

with open(os.path.join(os.path.dirname(FIXTURES), "hf_defaults.json")) as f:
  DEFAULTS = json.load(f)
CASES = DEFAULTS["configs"]


def edited_config(case):
  """The case's config.json: its base fixture's, each dotted key set or dropped."""
  with open(os.path.join(FIXTURES, case["base"], case["file"])) as f:
    config = json.load(f)
  for key, value in case["edits"].items():
    *parents, last = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    if value == DEFAULTS["drop"]:
      node.pop(last, None)
    else:
      node[last] = copy.deepcopy(value)
  return config


def checkpoint(case, folder):
  """A checkpoint folder: the case's base weights under its edited config.json."""
  os.makedirs(folder, exist_ok=True)
  base = os.path.join(FIXTURES, case["base"])
  for name in os.listdir(base):
    if name.endswith(".safetensors"):
      os.symlink(os.path.join(base, name), os.path.join(folder, name))
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(edited_config(case), f)
  return str(folder)


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_reads_as_transformers_resolves_it(name):
  case = CASES[name]
  resolved = case["resolved"]
  config = config_from_hf(edited_config(case))
  assert config.max_position_embeddings == resolved["max_position_embeddings"]
  rope = resolved["rope"]
  if rope["rope_type"] in ("llama3", "yarn", "longrope"):
    assert config.rope_scaling["rope_type"] == rope["rope_type"]
    assert (config.rope_scaling["original_max_position_embeddings"]
            == rope["original_max_position_embeddings"])
    if rope.get("factor") is not None:
      assert config.rope_scaling["factor"] == rope["factor"]
  types = resolved["layer_types"]
  window = resolved["sliding_window"] or None  # Qwen2-MoE: 0 is none
  want = [window if types is None or types[i] == "sliding_attention" else None
          for i in range(config.num_layers)]
  assert [config.layer_window(i) for i in range(config.num_layers)] == want


def test_yarn_reads_alike_from_either_layout_and_defaults_its_factor():
  five, four = (config_from_hf(edited_config(CASES[n]))
                for n in ("yarn_5x_no_original", "yarn_4x_no_original"))
  assert five == four
  # transformers' YaRN takes max_position_embeddings / original context for a null factor.
  scaling = config_from_hf(edited_config(CASES["yarn_null_factor"])).rope_scaling
  assert scaling["factor"] == 128 / 8


# The config test above holds the others' fields equal to transformers'; these run the math.
@pytest.mark.parametrize("name", [
    "yarn_5x_no_original", "phi3_no_top_level_original",
    *(pytest.param(n, marks=pytest.mark.slow) for n in (
        "yarn_null_factor", "llama3_no_original", "phi3_top_level_original_wins"))])
def test_logits_equal_transformers(name, tmp_path):
  case = CASES[name]
  model = load_hf_checkpoint(checkpoint(case, tmp_path / "ckpt"), dtype="float32")
  tokens = reference(case["base"])[0][:1]
  logits = np.asarray(forward(model, jnp.asarray(tokens)))[0, case["positions"]]
  np.testing.assert_allclose(logits, np.asarray(case["logits"], np.float32), rtol=0, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral_no_window", "qwen2_window_default"])
def test_default_windows_give_transformers_logits_past_them(name, tmp_path):
  case = CASES[name]
  model = load_hf_checkpoint(checkpoint(case, tmp_path / "ckpt"), dtype="float32")
  length, vocab = DEFAULTS["long_len"], model.config.vocab_size
  tokens = ((np.arange(length) * 7919 + 13) % vocab)[None].astype(np.int32)
  logits = np.asarray(forward(model, jnp.asarray(tokens)))[0, case["positions"]]
  np.testing.assert_allclose(logits, np.asarray(case["logits"], np.float32), rtol=0, atol=2e-5)
