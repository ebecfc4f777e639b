"""Reward models: a transformers sequence classifier read into our Transformer scores as
transformers does, and a checkpoint that is not one is refused naming what is wrong."""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from rlax_ps.models.reward_model import load_reward_model, pooled_index
from tests.models.hf_fixtures import FIXTURES

RM = os.path.join(FIXTURES, "qwen3_reward")


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


def test_a_missing_score_head_is_named(tmp_path):
  with pytest.raises(ValueError, match="missing tensor 'score.weight'"):
    load_reward_model(_copy(tmp_path, drop="score.weight"))
