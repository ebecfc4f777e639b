"""On-policy distillation's teacher (loss.advantage="opd"): a frozen Hugging Face checkpoint
on the trainer's mesh that scores every token the workers sampled, once a step."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from rlax_ps import sharding as shd
from rlax_ps.models.hf import load_hf_checkpoint
from rlax_ps.train.rl_loss import response_logprobs

# The batch's keys of the student's own expert routes: the teacher routes its own tokens.
_ROUTES = ("prompt_routes", "response_routes")


class Teacher:
  """The teacher's params and its jitted log-probs of a batch's responses."""

  def __init__(self, path: str, mesh, *, vocab_size: int, dtype: str = "bfloat16",
               backend: str = "auto", logits_chunk: int = 0):
    """`vocab_size`: the ids the policy's tokenizer gives, each of which the teacher must
    score (the two share a tokenizer: distillation compares their log-probs token by
    token)."""
    try:
      model = load_hf_checkpoint(path, dtype, mesh=mesh)
    except (OSError, ValueError) as e:
      raise ValueError(f"teacher.path: HF checkpoint {path!r}: {e}") from None
    if model.config.vocab_size < vocab_size:
      raise ValueError(f"teacher.path: {path!r} scores {model.config.vocab_size} token ids, "
                       f"the policy's tokenizer gives {vocab_size}: expected a teacher of the "
                       f"same tokenizer")
    self.config = model.config
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    self.params = params.to_pure_dict()

    def logprobs(params, batch):
      batch = {k: v for k, v in batch.items() if k not in _ROUTES}
      logp = response_logprobs(params, graphdef, batch, backend, logits_chunk=logits_chunk)
      logp = jax.lax.stop_gradient(logp).reshape(batch["response_tokens"].shape)
      # laid out as the step's other batch inputs (its programs compiled ahead expect it)
      return jax.lax.with_sharding_constraint(
          logp, NamedSharding(mesh, shd.batch_spec(mesh, logp.shape)))

    self._logprobs = jax.jit(logprobs)

  def logprobs(self, batch: dict) -> jax.Array:
    """[rows, N, R] the teacher's log-prob of each response token of `batch`."""
    return self._logprobs(self.params, batch)
