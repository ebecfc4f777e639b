"""Reward models: a transformers sequence classifier read into our Transformer scores as
transformers does, and a checkpoint that is not one is refused naming what is wrong."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from rlax_ps.models import config_from_hf
from rlax_ps.models.reward_model import load_reward_model, pooled_index
from rlax_ps.models.value_model import source_config, source_params
from tests.models.hf_fixtures import FIXTURES

RM = os.path.join(FIXTURES, "qwen3_reward")
VISION = os.path.join(FIXTURES, "gemma3_vision")


@nnx.jit
def _scores(model, tokens, last):
  return model(tokens, last)


def test_scores_equal_transformers_on_right_padded_rows():
  ref = np.load(os.path.join(RM, "reference.npz"))
  model = load_reward_model(RM, "float32")
  assert model.pad_id == 0 and model.config.architecture == "qwen3"  # <|endoftext|>
  last = [pooled_index(row, model.pad_id) for row in ref["tokens"]]
  assert last == [19, 13, 19]  # the pad id inside row 2 is not where it is pooled
  got = np.asarray(_scores(model, ref["tokens"], np.asarray(last)))
  np.testing.assert_allclose(got, ref["scores"], rtol=2e-5, atol=2e-5)
  # Trailing padding changes nothing: the same row cut at its pooled token scores alike.
  cut = ref["tokens"][1:2, :14]
  np.testing.assert_allclose(np.asarray(_scores(model, cut, np.asarray([13])))[0],
                             ref["scores"][1], rtol=2e-5, atol=2e-5)


def test_pooled_index_follows_transformers():
  assert pooled_index([5, 6, 0, 7, 0, 0], 0) == 3
  assert pooled_index([5, 6, 7], None) == 2
  assert pooled_index([0, 0], 0) == 0  # argmax of an all-pad row


def _copy(tmp_path, config=None, drop=None):
  path = tmp_path / "rm"
  shutil.copytree(RM, path)
  if config is not None:
    with open(path / "config.json") as f:
      d = json.load(f)
    d.update(config)
    with open(path / "config.json", "w") as f:
      json.dump(d, f)
  if drop is not None:
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(path / "model.safetensors"))
  return str(path)


def test_a_causal_lm_is_not_a_reward_model(tmp_path):
  with pytest.raises(ValueError, match="architectures: expected a reward model.*"
                     "Qwen3ForSequenceClassification.*got \\['Qwen3ForCausalLM'\\]"):
    load_reward_model(_copy(tmp_path, {"architectures": ["Qwen3ForCausalLM"]}))


def test_a_config_that_is_not_valid_json_is_named(tmp_path):
  path = _copy(tmp_path)
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write("{bad")
  config = load_reward_model(RM, "float32").config
  for read in (load_reward_model, source_config, lambda p: source_params(p, config)):
    with pytest.raises(ValueError, match=re.escape(f"{path}/config.json: not valid JSON")):
      read(path)


def test_a_missing_score_head_is_named(tmp_path):
  with pytest.raises(ValueError, match="missing tensor 'score.weight'"):
    load_reward_model(_copy(tmp_path, drop="score.weight"))


def _gemma3_classifier(tmp_path, **fields):
  """A Gemma3ForSequenceClassification folder as transformers saves one: the image-text
  fixture's config (the language model's shape in text_config) and tensors (language model,
  vision tower, projector) with a score head of two labels, embed_tokens' rows 5 and 7, so
  that its scores are the causal model's logits of tokens 5 and 7; `fields` edit the top."""
  with open(os.path.join(VISION, "config.json")) as f:
    d = json.load(f)
  d.update(architectures=["Gemma3ForSequenceClassification"], **fields)
  tensors = load_file(os.path.join(VISION, "model.safetensors"))
  tensors["score.weight"] = tensors["language_model.model.embed_tokens.weight"][[5, 7]]
  path = tmp_path / "g3rm"
  os.mkdir(path)
  save_file(tensors, str(path / "model.safetensors"))
  with open(path / "config.json", "w") as f:
    json.dump(d, f)
  return str(path)


def test_an_image_text_classifier_is_its_text_configs_model(tmp_path):
  """Gemma3ForSequenceClassification states its language model in text_config; read from the
  top level it took Gemma 3's default shapes ('missing tensor model.layers.3...')."""
  path = _gemma3_classifier(tmp_path)
  model = load_reward_model(path, "float32")
  with open(os.path.join(VISION, "config.json")) as f:
    assert model.config == config_from_hf(json.load(f))  # (tied already)
  assert source_config(path) == model.config  # a critic starting from it reads it alike
  assert model.pad_id == 0  # text_config's, as transformers' get_text_config() reads it
  ref = np.load(os.path.join(VISION, "reference.npz"))
  last = np.asarray([pooled_index(row, model.pad_id) for row in ref["tokens"]])
  got = np.asarray(_scores(model, ref["tokens"], last))
  want = ref["logits"][np.arange(len(last)), last][:, [5, 7]]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_an_image_text_classifiers_quantization_is_checked(tmp_path):
  path = _gemma3_classifier(tmp_path, quantization_config={"quant_method": "bitsandbytes"})
  with pytest.raises(ValueError, match="quant_method: expected none.*got 'bitsandbytes'"):
    load_reward_model(path)
