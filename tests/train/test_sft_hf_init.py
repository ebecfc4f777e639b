"""SFT can start from a Hugging Face checkpoint folder: its config, weights and tokenizer."""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

from rlax_ps import config_files
from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer
from rlax_ps.train.sft import SFTTrainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = CharTokenizer()


def _tiny_config():
  return config_files.load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("pretrained"))
  config = ModelConfig(vocab_size=TOK.vocab_size + 5, hidden_size=32, intermediate_size=64,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                       architecture="qwen2")
  model = Transformer(config, rngs=nnx.Rngs(11))
  save_hf_checkpoint(model, path)
  TOK.save(path)
  return path, nnx.state(model, nnx.Param).to_pure_dict()


def test_starts_from_the_checkpoint_weights_and_tokenizer(pretrained, tmp_path):
  path, params = pretrained
  config = _tiny_config()
  config.init_from_hf = path
  config.tokenizer.kind = "hf"
  with SFTTrainer(config, str(tmp_path), devices=jax.devices()[:2]) as trainer:
    assert trainer.step == 0
    assert trainer.model_config.architecture == "qwen2" and trainer.model_config.qkv_bias
    assert isinstance(trainer.tokenizer, HFTokenizer)
    assert trainer.tokenizer.encode("rev ab=") == TOK.encode("rev ab=")
    for (p, want), got in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(trainer.state.params)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                    err_msg=jax.tree_util.keystr(p))
    # Optimizer state created on the mesh, laid out like the params, starting from zero.
    mu = trainer.state.opt_state.inner_state[1][0].mu
    assert jax.tree.map(lambda x: x.sharding, trainer.state) == trainer.shardings
    assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(mu))
    assert jax.tree.structure(mu) == jax.tree.structure(params)


def test_vocab_smaller_than_the_tokenizer_is_an_error(pretrained, tmp_path):
  path, _ = pretrained
  config = _tiny_config()
  config.init_from_hf = path
  config.tokenizer.alphabet = "".join(chr(c) for c in range(0x100, 0x200))  # 259 ids.
  with pytest.raises(ValueError, match="tokenizer.kind: 'char' .* not the tokenizer of the "
                                       "checkpoint"):  # it ships its own (99 ids)
    SFTTrainer(config, str(tmp_path / "a"), devices=jax.devices()[:1])
  bare = tmp_path / "bare"  # a checkpoint without a tokenizer: its vocabulary is too small
  bare.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(path, name), bare / name)
  config.init_from_hf = str(bare)
  with pytest.raises(ValueError, match="init_from_hf: the model's vocab_size 104"):
    SFTTrainer(config, str(tmp_path / "b"), devices=jax.devices()[:1])


def test_a_resume_from_another_checkpoint_says_what_comes_from_which(pretrained, tmp_path,
                                                                     caplog):
  """init_from_hf changed between runs of one workdir: the weights resumed are the
  checkpoint's, the tokenizer (and a KL reference, a PEFT base) the new folder's, silently."""
  path, _ = pretrained
  other = str(tmp_path / "other")
  shutil.copytree(path, other)
  config = _tiny_config()
  config.init_from_hf, config.tokenizer.kind = path, "hf"
  config.train.steps, config.checkpoint.every_steps = 1, 0
  config.export.hf = False
  with SFTTrainer(config, str(tmp_path / "run"), devices=jax.devices()[:1]) as trainer:
    trainer.train(progress=False)
  for init, warned in ((path, False), (other, True)):
    config.init_from_hf = init
    caplog.clear()
    with SFTTrainer(config, str(tmp_path / "run"), devices=jax.devices()[:1]) as trainer:
      assert trainer.step == 1
    said = [r.getMessage() for r in caplog.records if "init_from_hf:" in r.getMessage()]
    assert bool(said) == warned, said
  assert f"{path!r} in the checkpoint (step 1), {other!r} now: the run resumes" in said[0]


def test_a_tensor_axis_that_cannot_split_the_heads_is_said_at_start(monkeypatch):
  """The tiny model's 4 query heads on tensor=8: every device would compute every head."""
  said = []
  monkeypatch.setattr(SFTTrainer, "check_mesh", lambda self: said.append(self.mesh))
  monkeypatch.setattr(SFTTrainer, "_records", lambda self: (_ for _ in ()).throw(KeyError()))
  config = _tiny_config()
  config.mesh.data, config.mesh.tensor = 1, 8
  with pytest.raises(KeyError):
    SFTTrainer(config, tempfile.mkdtemp())  # (built as far as its data)
  assert said and said[0].shape["tensor"] == 8
