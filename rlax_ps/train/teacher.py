"""On-policy distillation's teacher (loss.advantage="opd", loss.distill_topk): a frozen
Hugging Face checkpoint on the trainer's mesh that scores every token the workers sampled,
and names its own top tokens at each sampled position, once a step."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from rlax_ps import sharding as shd
from rlax_ps.kernels import pack_group, packed_response_topk
from rlax_ps.models.hf import load_hf_checkpoint
from rlax_ps.train.rl_loss import response_logprobs

# The batch's keys of the student's own expert routes: the teacher routes its own tokens.
_ROUTES = ("prompt_routes", "response_routes")


class Teacher:
  """The teacher's params and its jitted scores of a batch's responses."""

  def __init__(self, path: str, mesh, *, vocab_size: int, dtype: str = "bfloat16",
               backend: str = "auto", logits_chunk: int = 0, sampled: bool = True,
               topk: int = 0):
    """`vocab_size`: the ids the policy's tokenizer gives, each of which the teacher must
    score (the two share a tokenizer: distillation compares their log-probs token by
    token). `sampled`: `scores` gives the log-prob of each sampled token (opd's
    advantages); `topk` > 0: the teacher's k most likely tokens at each position too."""
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

    def place(x):  # laid out as the step's other batch inputs (its compiled programs expect it)
      return jax.lax.with_sharding_constraint(
          jax.lax.stop_gradient(x), NamedSharding(mesh, shd.batch_spec(mesh, x.shape)))

    def scores(params, batch):  # one forward pass of the teacher either way
      batch = {k: v for k, v in batch.items() if k not in _ROUTES}
      out = {}
      if topk:
        tokens, layout = pack_group(batch["prompt_tokens"], batch["prompt_lens"],
                                    batch["response_tokens"], batch["response_lens"])
        logp, ids, top = packed_response_topk(
            nnx.merge(graphdef, params), tokens, batch["response_tokens"], layout, topk,
            backend=backend, logits_chunk=logits_chunk)
        out["teacher_topk_ids"], out["teacher_topk_logp"] = place(ids), place(top)
      else:
        logp = response_logprobs(params, graphdef, batch, backend, logits_chunk=logits_chunk)
      if sampled:
        out["teacher_logp"] = place(logp.reshape(batch["response_tokens"].shape))
      return out

    self._scores = jax.jit(scores)

  def scores(self, batch: dict) -> dict[str, jax.Array]:
    """The batch's teacher inputs: `teacher_logp` [rows, N, R] the teacher's log-prob of each
    response token (`sampled`); `teacher_topk_ids`, `teacher_topk_logp` [rows, N, R, k] its
    k most likely tokens at each response position and their log-probs (`topk`)."""
    return self._scores(self.params, batch)
