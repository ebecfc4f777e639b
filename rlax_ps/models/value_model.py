"""PPO's critic: a Transformer body with a linear value head, one value per position.

The body is the policy's architecture without its LM head (tied: no `lm_head` param, and the
head is never applied), LoRA adapters included when the policy has them, so it starts from
the policy's weights; the head starts at zero, so the first values are 0 and the first
advantages the returns. Or it starts from a Hugging Face checkpoint of its own
(critic.init_from_hf): a reward model, its score head the value head (InstructGPT's
critic), or a causal LM with a zero head.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_ps.kernels import pack_group, pack_routes
from rlax_ps.kernels.packing import packed_attention_fn, response_logit_index
from rlax_ps.models.config import ModelConfig
from rlax_ps.models.hf import CONFIG_FILE, config_from_hf, load_hf_checkpoint, read_json
from rlax_ps.models.reward_model import load_reward_model, reward_config
from rlax_ps.models.transformer import Transformer


def critic_config(config: ModelConfig) -> ModelConfig:
  """The value model's body config for a policy of `config`: its LM head off."""
  return config.replace(tie_word_embeddings=True)


class ValueModel(nnx.Module):
  """A Transformer body (critic_config's) and a value head: hidden [.., H] -> float32 values
  [..] (head . h + bias)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.body = Transformer(config, rngs=rngs)
    self.value_head = nnx.Param(jnp.zeros((config.hidden_size,), jnp.float32))
    self.value_bias = nnx.Param(jnp.zeros((), jnp.float32))

  @property
  def config(self) -> ModelConfig:
    return self.body.config

  def values(self, hidden: jax.Array) -> jax.Array:
    return (jnp.einsum("...h,h->...", hidden.astype(jnp.float32), self.value_head[...])
            + self.value_bias[...])


def _is_reward_model(d: dict) -> bool:
  return any(a.endswith("ForSequenceClassification") for a in d.get("architectures") or [])


def source_config(path: str) -> ModelConfig:
  """The body config of the HF checkpoint folder `path` a critic starts from: a
  `*ForSequenceClassification` reward model's or a causal LM's, tied (no LM head)."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no {CONFIG_FILE} in HF checkpoint folder {path!r}")
  d = read_json(file)
  config = reward_config(d) if _is_reward_model(d) else config_from_hf(d)
  return config.replace(tie_word_embeddings=True)


def source_params(path: str, config: ModelConfig, mesh: jax.sharding.Mesh | None = None
                  ) -> dict:
  """A ValueModel's params (a pure dict) from the HF checkpoint folder `path` of body config
  `config` (source_config's, in the run's dtypes): a reward model's body and its one-label
  score head as the value head; a causal LM's body (its LM head dropped) and a zero head."""
  if _is_reward_model(read_json(os.path.join(path, CONFIG_FILE))):
    model = load_reward_model(path, config.param_dtype, compute_dtype=config.dtype, mesh=mesh)
    score = model.score[...]
    if score.shape[1] != 1:
      raise ValueError(f"{path!r}: a reward model of {score.shape[1]} labels; a critic's "
                       f"value head takes one")
    body, head = model.body, score[:, 0].astype(jnp.float32)
  else:
    body = load_hf_checkpoint(path, config.param_dtype, compute_dtype=config.dtype, mesh=mesh)
    head = jnp.zeros((config.hidden_size,), jnp.float32)
  params = nnx.state(body, nnx.Param).to_pure_dict()
  params.pop("lm_head", None)
  return {"body": params, "value_head": head, "value_bias": jnp.zeros((), jnp.float32)}


def packed_values(model: ValueModel, batch: dict, *, backend: str = "auto",
                  remat: bool = False, replay_routes: bool = True) -> jax.Array:
  """[rows, N, R] the critic's value of the state before each response token (the position
  whose logit would predict it), one packed row per group as the policy's log-probs are
  computed (the prompt runs once); 0 past each response's end. A batch with routes (routing
  replay) sends each token to the experts the workers' sampler did, unless not
  `replay_routes` (a critic of another model, whose experts those are not)."""
  tokens, layout = pack_group(batch["prompt_tokens"], batch["prompt_lens"],
                              batch["response_tokens"], batch["response_lens"])
  routes = (pack_routes(batch["prompt_routes"], batch["response_routes"])
            if replay_routes and "prompt_routes" in batch else None)
  hidden, *_ = model.body.hidden_states(
      tokens, positions=layout.positions(), segment_ids=layout.segment_ids(),
      attention_fn=packed_attention_fn(layout, backend=backend), remat=remat, routes=routes)
  b, n, r = layout.batch, layout.num_responses, layout.response_capacity
  idx = response_logit_index(layout).reshape(b, n * r)
  values = model.values(jnp.take_along_axis(hidden, idx[:, :, None], axis=1)).reshape(b, n, r)
  valid = jnp.arange(r)[None, None, :] < layout.response_lens[:, :, None]
  return jnp.where(valid, values, 0.0)
