"""SFT can start from a Hugging Face checkpoint folder: its config, weights and tokenizer."""

import os
import shutil

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
