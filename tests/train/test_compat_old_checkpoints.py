"""A checkpoint an older rlax-ps wrote resumes under this one (tests/fixtures/compat: a real
old checkpoint): model fields added since take their defaults and a log line names them (an
RL checkpoint without an adaptive entropy coefficient starts it at loss.entropy_coef, saying so);
what is really incompatible stops before any step, naming the field."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from rlax_ps.config_files import load
from rl_testlib import rl_config
from rlax_ps.train.rl import RLTrainer
from rlax_ps.train.sft import SFTTrainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD_SFT = os.path.join(REPO, "tests", "fixtures", "compat", "sft_aa42d71", "checkpoints")
METADATA = os.path.join("checkpoints", "2", "metadata", "metadata")


def _config(**model):
  """The fixture's config (see its README), with `model` fields changed."""
  config = load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")
  config.train.steps = 2
  config.checkpoint.every_steps = 0
  config.checkpoint.async_save = False
  config.export.hf = False
  config.model.update(dict(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1),
                      **model)
  return config


def _old_workdir(tmp_path, **model_config):
  """A workdir holding the old checkpoint, its recorded model config updated by
  `model_config`."""
  shutil.copytree(OLD_SFT, tmp_path / "checkpoints")
  path = tmp_path / METADATA
  saved = json.loads(path.read_text())
  saved["model_config"].update(model_config)
  path.write_text(json.dumps(saved))
  return str(tmp_path)


def test_an_older_checkpoint_resumes_its_step_and_optimizer_with_new_fields_defaulted(
    tmp_path, caplog):
  config = _config()
  config.train.steps = 3
  with caplog.at_level("WARNING"):
    with SFTTrainer(config, _old_workdir(tmp_path)) as trainer:
      assert trainer.step == 2
      opt_state = jax.device_get(trainer.state.opt_state)
      leaves = jax.tree.leaves(opt_state.inner_state)
      assert [int(x) for x in leaves if np.issubdtype(x.dtype, np.integer)] == [2, 2]  # counts
      assert all(np.any(x != 0) for x in leaves if x.ndim)  # Adam's moments, not a fresh init
      # written before non-finite updates were skipped: their counts start at 0
      assert (int(opt_state.notfinite_count), int(opt_state.total_notfinite)) == (0, 0)
      trainer.train(progress=False)  # and the wrapped state trains on
      assert trainer.step == 3
  assert "predates fields added to the model config since" in caplog.text
  assert "predates the skipping of updates" in caplog.text
  assert "router_scoring='softmax'" in caplog.text


def test_a_field_idle_in_both_models_does_not_stop_a_resume(tmp_path):
  """LoRA's targets without LoRA (whose default grows with new architectures) build no
  weights: a checkpoint that recorded others resumes."""
  with SFTTrainer(_config(), _old_workdir(tmp_path, lora_targets=["q_proj"])) as trainer:
    assert trainer.step == 2


@pytest.mark.parametrize("model, saved, message", [
    ({"rope_theta": 20000.0}, {}, "model.rope_theta: 10000.0 in the checkpoint, 20000.0 now"),
    ({}, {"future_field": 1}, "model.future_field: 1 in the checkpoint, a field this rlax-ps "
                              "does not know"),
])
def test_a_model_the_checkpoint_was_not_written_for_is_refused_naming_the_field(
    tmp_path, model, saved, message):
  with pytest.raises(ValueError, match=message):
    SFTTrainer(_config(**model), _old_workdir(tmp_path, **saved))

def test_an_rl_checkpoint_without_an_entropy_coefficient_starts_it_at_the_config_saying_so(
    tmp_path, caplog):
  config = rl_config("tiny")
  config.loss.adaptive_entropy, config.loss.entropy_coef = True, 0.01
  with RLTrainer(config, str(tmp_path), object()) as tr:
    older = {k: v for k, v in tr.metadata().items() if k != "entropy_control"}
    with caplog.at_level("WARNING"):
      tr._load_metadata(older)
    assert tr.entropy_coef == 0.01
  assert ("loss.adaptive_entropy: the checkpoint at step 0 holds no entropy coefficient"
          in caplog.text and "loss.entropy_coef=0.01" in caplog.text)


def test_an_older_lora_model_has_todays_default_targets_without_latent_attention():
  """An older rlax-ps's default LoRA targets are today's for a model without latent
  attention (whose projections are targets too now): its LoRA runs resume."""
  from rlax_ps.models import ModelConfig
  from rlax_ps.train.state import model_changes
  with open(os.path.join(OLD_SFT, "2", "metadata", "metadata")) as f:
    saved = json.load(f)["model_config"]
  saved.update(lora_rank=2, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj", "experts"])  # aa42d71's
  now = ModelConfig.from_dict({k: v for k, v in saved.items() if k != "lora_targets"})
  assert model_changes(saved, now)[0] == []
