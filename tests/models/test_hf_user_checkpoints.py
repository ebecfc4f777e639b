"""Checkpoints users bring that we do not load: each refused by name, and found without
reading weights (check_hf_checkpoint) so that a command can name them before it starts."""

import json
import os
import re
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from rlax_ps.models.hf import check_hf_checkpoint, config_from_hf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")


def llama_folder(tmp_path, tensors):
  """The llama fixture's config.json, with `tensors` as model.safetensors."""
  shutil.copy(os.path.join(FIXTURES, "llama", "config.json"), tmp_path / "config.json")
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  return str(tmp_path)


def test_torch_pickle_weights_are_named_with_what_to_do(tmp_path):
  shutil.copy(os.path.join(FIXTURES, "llama", "config.json"), tmp_path / "config.json")
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(FileNotFoundError, match=re.escape(
      "its weights are in pytorch_model.bin, a torch pickle, which is not read: save them as "
      "safetensors")):
    check_hf_checkpoint(str(tmp_path))


def test_the_check_gives_the_config_of_a_good_checkpoint():
  config = check_hf_checkpoint(os.path.join(FIXTURES, "qwen2_sharded"))
  assert (config.architecture, config.vocab_size) == ("qwen2", 64)


def test_the_check_names_a_missing_or_unexpected_tensor(tmp_path):
  tensors = load_file(os.path.join(FIXTURES, "llama", "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  (tmp_path / "a").mkdir()
  with pytest.raises(ValueError, match=re.escape(
      "missing tensor 'model.layers.1.mlp.up_proj.weight'")):
    check_hf_checkpoint(llama_folder(tmp_path / "a", tensors))
  tensors = load_file(os.path.join(FIXTURES, "llama", "model.safetensors"))
  tensors["model.layers.0.self_attn.q_proj.bias"] = tensors["model.norm.weight"]
  (tmp_path / "b").mkdir()
  with pytest.raises(ValueError, match=re.escape(
      "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'")):
    check_hf_checkpoint(llama_folder(tmp_path / "b", tensors))


def test_the_check_names_a_shard_the_index_names_but_the_folder_lacks(tmp_path):
  shutil.copytree(os.path.join(FIXTURES, "qwen2_sharded"), tmp_path / "ckpt")
  os.remove(tmp_path / "ckpt" / "model-00002-of-00003.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
    check_hf_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("name,dropped,want", [
    ("mixtral", ("rms_norm_eps", "rope_parameters"), {"rms_norm_eps": 1e-5, "rope_theta": 1e6}),
    ("smollm3", ("tie_word_embeddings", "rope_parameters"),
     {"tie_word_embeddings": True, "rope_theta": 2e6}),
])
def test_fields_a_config_leaves_out_take_transformers_defaults(name, dropped, want):
  # What transformers 5.25's AutoConfig reads from these config.json files, the fields gone.
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    d = json.load(f)
  for field in dropped:
    del d[field]
  config = config_from_hf(d)
  assert {field: getattr(config, field) for field in want} == want
