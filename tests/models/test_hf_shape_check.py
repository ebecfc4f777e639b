"""check_hf_checkpoint compares each tensor's shape in the safetensors headers with the one
load_hf_checkpoint requires (no weights read), so that a config.json of another size is
named before a command starts."""

import json
import os
import re
import shutil

import pytest

from rlax_ps.models import hf
from rlax_ps.models.hf import check_hf_checkpoint, load_hf_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")


def copy_fixture(tmp_path, name, **config_changes):
  """Fixture `name`'s config.json (with `config_changes`) and safetensors, in tmp_path."""
  source = os.path.join(FIXTURES, name)
  for f in os.listdir(source):
    if f.endswith(".safetensors") or f == hf.INDEX_FILE:
      shutil.copy(os.path.join(source, f), tmp_path / f)
  with open(os.path.join(source, "config.json")) as f:
    config = json.load(f)
  (tmp_path / "config.json").write_text(json.dumps({**config, **config_changes}))
  return str(tmp_path)


# (fixture, config.json change, the first tensor that no longer fits, its expected and
# stored shape as the loader reads it).
MISFITS = [
    ("llama", {"intermediate_size": 80}, "model.layers.0.mlp.down_proj.weight",
     (48, 80), (48, 64)),
    ("qwen2_sharded", {"intermediate_size": 80}, "model.layers.0.mlp.down_proj.weight",
     (32, 80), (32, 64)),
    # Phi-3's fused q, k, v rows: two more kv heads of 8 dims each need 32 more rows.
    ("phi3", {"num_key_value_heads": 4}, "model.layers.0.self_attn.qkv_proj.weight",
     (96, 32), (64, 32)),
    # Mixtral's per-expert tensors of a stacked param.
    ("mixtral", {"intermediate_size": 24},
     "model.layers.0.block_sparse_moe.experts.0.w1.weight", (24, 32), (16, 32)),
    # gpt-oss's stacked experts in MXFP4: the shape they dequantize to, from the headers.
    ("gpt_oss_mxfp4", {"intermediate_size": 64}, "model.layers.0.mlp.experts.down_proj",
     (4, 64, 64), (4, 32, 64)),
    # GLM-4.5's shared experts: two of them make one MLP twice as wide.
    ("glm4_moe", {"n_shared_experts": 2}, "model.layers.1.mlp.shared_experts.down_proj.weight",
     (32, 32), (32, 16)),
    # DeepSeek's latent attention: a wider kv latent (kv_lora_rank) than the checkpoint's.
    ("deepseek_v3", {"kv_lora_rank": 16},
     "model.layers.0.self_attn.kv_a_layernorm.weight", (16,), (12,)),
]


@pytest.mark.parametrize("name,change,tensor,want,got", MISFITS,
                         ids=[m[0] for m in MISFITS])
def test_a_config_of_another_size_names_the_tensor_and_both_shapes(
    tmp_path, name, change, tensor, want, got):
  path = copy_fixture(tmp_path, name, **change)
  message = f"tensor {tensor!r}: expected shape {want}, got {got}"
  with pytest.raises(ValueError, match=re.escape(f"HF checkpoint {path!r}: {message}")):
    check_hf_checkpoint(path)
  if name != "qwen2_sharded":  # the loader's own words (it reads a sharded one by file)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
      load_hf_checkpoint(path)


@pytest.mark.parametrize("name", ["llama", "qwen2_sharded", "phi3", "glm4", "mixtral",
                                  "qwen2_moe", "gpt_oss", "gpt_oss_mxfp4", "gemma3_vision",
                                  "glm4_moe", "deepseek_v3", "deepseek_v2", "deepseek_v3_fp8",
                                  "qwen3_fp8_dynamic"])
def test_good_checkpoints_pass(name):
  # Fused rows (phi3, glm4), per-expert (mixtral, qwen2_moe) and stacked, interleaved
  # (gpt_oss) experts, MXFP4, tied embeddings, an image-text checkpoint's text model and
  # GLM-4.5's router with its correction bias.
  check_hf_checkpoint(os.path.join(FIXTURES, name))  # raises on any tensor it misjudges


class _HeadersOnly:
  """safe_open whose files give their headers but refuse to read any tensor."""
  _safe_open = hf.safe_open

  def __init__(self, *args, **kwargs):
    self._file = type(self)._safe_open(*args, **kwargs)

  def __enter__(self):
    self._open = self._file.__enter__()
    return self

  def __exit__(self, *exc):
    return self._file.__exit__(*exc)

  def keys(self):
    return self._open.keys()

  def get_slice(self, name):
    return self._open.get_slice(name)

  def get_tensor(self, name):
    raise AssertionError(f"tensor {name!r} read")


def test_the_shapes_come_from_the_headers_alone(tmp_path, monkeypatch):
  good = os.path.join(FIXTURES, "gpt_oss_mxfp4")
  (tmp_path / "bad").mkdir()
  bad = copy_fixture(tmp_path / "bad", "phi3", num_key_value_heads=4)
  monkeypatch.setattr(hf, "safe_open", _HeadersOnly)
  assert check_hf_checkpoint(good).architecture == "gpt_oss"
  with pytest.raises(ValueError, match=re.escape(
      "tensor 'model.layers.0.self_attn.qkv_proj.weight': expected shape (96, 32), got "
      "(64, 32)")):
    check_hf_checkpoint(bad)
  with pytest.raises(AssertionError, match="read"):  # the loader does read through it
    load_hf_checkpoint(good)


def test_a_tensor_the_index_places_in_a_shard_without_it_is_named(tmp_path):
  path = copy_fixture(tmp_path, "qwen2_sharded")
  index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
  weight_map = index["weight_map"]
  name = "model.norm.weight"
  weight_map[name] = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
  (tmp_path / hf.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(ValueError, match=re.escape(
      f"HF checkpoint {path!r}: tensor {name!r}: {hf.INDEX_FILE} places it in ")):
    check_hf_checkpoint(path)


def test_a_cut_short_weights_file_is_named_not_a_safetensors_error(tmp_path):
  """An interrupted download: the check and the loader name the file in one ValueError."""
  folder = tmp_path / "cut"
  shutil.copytree(os.path.join(FIXTURES, "llama"), folder)
  weights = folder / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-100])
  for call in (check_hf_checkpoint, load_hf_checkpoint):
    with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file .*cut "
                                         "short"):
      call(str(folder))
