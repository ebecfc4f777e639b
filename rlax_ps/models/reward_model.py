"""Reward models: a Hugging Face `*ForSequenceClassification` checkpoint (a causal LM's body,
any family of `hf.ARCHITECTURES`, with a linear `score` head and no LM head; Gemma 3's
image-text classifier: its language model's), read into our Transformer, and its score of
each sequence at the token transformers pools."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_ps.models.config import ModelConfig, dtype_name
from rlax_ps.models.hf import (ARCHITECTURES, CONFIG_FILE, config_from_hf, language_model_config,
                               load_hf_params, place_params, read_json)
from rlax_ps.models.transformer import Transformer

SCORE_TENSOR = "score.weight"  # [num_labels, hidden], as transformers stores the head
_SUFFIX = "ForSequenceClassification"


class RewardModel(nnx.Module):
  """A Transformer body and a score head: tokens [B, T] -> float32 scores [B, num_labels]."""

  def __init__(self, body: Transformer, score: jax.Array, pad_id: int | None = None):
    self.body = body
    self.score = nnx.Param(score)  # [hidden, num_labels]
    self.pad_id = pad_id  # transformers pools at the last token that is not this one

  @property
  def config(self) -> ModelConfig:
    return self.body.config

  def __call__(self, tokens, last):
    """Each row's scores at its token `last` [B] (right padding after it is not attended:
    attention is causal)."""
    hidden, _ = self.body.hidden_states(tokens)
    pooled = jnp.take_along_axis(hidden, jnp.asarray(last, jnp.int32)[:, None, None], axis=1)
    head = self.score[...].astype(hidden.dtype)
    return jnp.einsum("bh,hl->bl", pooled[:, 0], head, preferred_element_type=jnp.float32)


def pooled_index(ids, pad_id: int | None) -> int:
  """The token transformers' sequence classifiers score: the last one that is not the pad
  token (the first where every token is, the last without a pad token)."""
  ids = np.asarray(ids)
  if pad_id is None:
    return len(ids) - 1
  real = np.flatnonzero(ids != pad_id)
  return int(real[-1]) if real.size else 0


def _text_config(d: dict) -> dict:
  """The language model's part of a sequence-classification config.json: an image-text
  classifier's (Gemma3ForSequenceClassification) text_config, which transformers' own
  get_text_config() reads; any other's is the whole."""
  return d["text_config"] if isinstance(d.get("text_config"), dict) else d


def reward_config(d: dict) -> ModelConfig:
  """The body's ModelConfig of a parsed sequence-classification config.json: the causal
  family's (an image-text classifier's: its language model's), untied (a reward model has
  no LM head to tie)."""
  archs = d.get("architectures") or []
  causal = [a[:-len(_SUFFIX)] + "ForCausalLM" for a in archs if a.endswith(_SUFFIX)]
  if not causal or causal[0] not in ARCHITECTURES:
    known = sorted(a.replace("ForCausalLM", _SUFFIX) for a in ARCHITECTURES)
    raise ValueError(f"{CONFIG_FILE}: architectures: expected a reward model, one of "
                     f"{known}, got {archs!r}")
  if _text_config(d) is not d:
    d = language_model_config(d, causal[0])
  return config_from_hf({**d, "architectures": causal[:1], "tie_word_embeddings": True})


def load_reward_model(path: str, dtype: str = "bfloat16", *, compute_dtype: str | None = None,
                      mesh: jax.sharding.Mesh | None = None) -> RewardModel:
  """The reward model in the HF checkpoint folder `path` (config.json + safetensors), its
  params in `dtype` and its activations in `compute_dtype` (default: the same)."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no {CONFIG_FILE} in reward model folder {path!r}")
  d = read_json(file)
  dtype = dtype_name(dtype)
  compute = dtype if compute_dtype is None else dtype_name(compute_dtype, "compute_dtype")
  config = reward_config(d).replace(param_dtype=dtype, dtype=compute)
  flat = load_hf_params(path, config, extra=(SCORE_TENSOR,))
  score = flat.pop(SCORE_TENSOR)
  if score.ndim != 2 or score.shape[1] != config.hidden_size:
    raise ValueError(f"tensor {SCORE_TENSOR!r}: expected shape [num_labels, "
                     f"{config.hidden_size}], got {score.shape}")
  pad = _text_config(d).get("pad_token_id")
  pad = pad[0] if isinstance(pad, list) else pad
  head = (jnp.asarray(score.T) if mesh is None else  # small: whole on every device
          jax.device_put(score.T, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  return RewardModel(place_params(config, flat, mesh), head,
                     None if pad is None else int(pad))
