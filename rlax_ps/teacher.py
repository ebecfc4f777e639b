"""On-policy distillation's teacher (loss.advantage="opd", loss.distill_topk): a frozen
Hugging Face checkpoint that scores every token the workers sampled and names its own top
tokens at each sampled position. It sits on the trainer's mesh (teacher.path: a step's
batch, once a step) or on each worker's devices (worker.teacher: each group as it
finishes, so the teacher's forward runs on the fleet beside decoding). A teacher of another
tokenizer (teacher.tokenizer, worker.teacher_tokenizer) scores the text of each response
(score_retokenized)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

from rlax_ps import sharding as shd
from rlax_ps.kernels import pack_group, packed_response_logprobs, packed_response_topk
from rlax_ps.models.hf import load_hf_checkpoint

# The batch's keys of the student's own expert routes: the teacher routes its own tokens.
_ROUTES = ("prompt_routes", "response_routes")
_MIN_PROMPT = 16  # a group's prompt is padded to powers of two from here: few programs


class Teacher:
  """The teacher's params and its jitted scores of a batch's responses."""

  def __init__(self, path: str, mesh, *, vocab_size: int, dtype: str = "bfloat16",
               backend: str = "auto", logits_chunk: int = 0, sampled: bool = True,
               topk: int = 0, field: str = "teacher.path", tokenizer=None,
               retokenized: bool = False):
    """`vocab_size`: the ids `tokenizer` gives, each of which the teacher must score and
    the only ones its top k may name; `tokenizer`: the policy's (distillation compares
    their log-probs token by token) or, `retokenized`, the teacher's own (it scores the
    text of each response), checked against the one the teacher's folder ships (None: not
    checked). `sampled`: `scores` gives the log-prob of each sampled token (opd's
    advantages); `topk` > 0: the teacher's k most likely tokens at each position too.
    `mesh` None: one device; `field`: the setting errors name."""
    from rlax_ps.tokenizers import other_ids
    own = "worker.teacher_tokenizer" if field.startswith("worker.") else "teacher.tokenizer"
    mismatch = "" if tokenizer is None else other_ids(tokenizer, path)
    if mismatch and retokenized:
      raise ValueError(f"{own}: {getattr(tokenizer, 'path', '?')!r} is not the tokenizer of "
                       f"the teacher {path!r} ({field}): {mismatch}")
    if mismatch:
      raise ValueError(f"{field}: {path!r}: {mismatch}; expected a teacher of the policy's "
                       f"tokenizer, or {own} set to score the text of each response")
    try:
      model = load_hf_checkpoint(path, dtype, mesh=mesh)
    except (OSError, ValueError) as e:
      raise ValueError(f"{field}: HF checkpoint {path!r}: {e}") from None
    if model.config.vocab_size < vocab_size:
      whose = "its own" if retokenized else "the policy's"
      raise ValueError(f"{field}: {path!r} scores {model.config.vocab_size} token ids, "
                       f"{whose} tokenizer gives {vocab_size}: expected a teacher of that "
                       f"tokenizer")
    self.config, self.topk = model.config, topk
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    self.params = params.to_pure_dict()

    def place(x):  # laid out as the step's other batch inputs (its compiled programs expect it)
      x = jax.lax.stop_gradient(x)
      if mesh is None:
        return x
      return jax.lax.with_sharding_constraint(
          x, NamedSharding(mesh, shd.batch_spec(mesh, x.shape)))

    def scores(params, batch):  # one forward pass of the teacher either way
      batch = {k: v for k, v in batch.items() if k not in _ROUTES}
      tokens, layout = pack_group(batch["prompt_tokens"], batch["prompt_lens"],
                                  batch["response_tokens"], batch["response_lens"])
      model = nnx.merge(graphdef, params)
      out = {}
      if topk:
        logp, ids, top = packed_response_topk(model, tokens, batch["response_tokens"], layout,
                                              topk, backend=backend, logits_chunk=logits_chunk,
                                              vocab_size=vocab_size)
        out["teacher_topk_ids"], out["teacher_topk_logp"] = place(ids), place(top)
      else:
        logp = packed_response_logprobs(model, tokens, batch["response_tokens"], layout,
                                        backend=backend, logits_chunk=logits_chunk)
      if sampled:
        out["teacher_logp"] = place(logp.reshape(batch["response_tokens"].shape))
      return out

    self._scores = jax.jit(scores)

  def scores(self, batch: dict) -> dict[str, jax.Array]:
    """The batch's teacher inputs: `teacher_logp` [rows, N, R] the teacher's log-prob of each
    response token (`sampled`); `teacher_topk_ids`, `teacher_topk_logp` [rows, N, R, k] its
    k most likely tokens at each response position and their log-probs (`topk`)."""
    return self._scores(self.params, batch)

  def score_group(self, prompt: Sequence[int], responses: Sequence[Sequence[int]],
                  samples: int, budget: int) -> list[tuple[np.ndarray, ...]]:
    """(A worker's.) One prompt's responses scored as one packed row of `samples` response
    slots of `budget` tokens (the prompt padded to a power of two): per response, its
    tokens' log-probs [t], and the top ids [t, k] int32 and log-probs [t, k] (`topk`; else
    None, None): the `teacher` of param_server.client.make_sample."""
    return self.score_groups([prompt], [responses], samples, budget)[0]

  def score_groups(self, prompts: Sequence[Sequence[int]],
                   responses: Sequence[Sequence[Sequence[int]]], samples: int,
                   budget: int, rows: int | None = None) -> list[list[tuple[np.ndarray, ...]]]:
    """score_group of each prompt and its responses: a packed row a prompt (the prompts
    padded to a power of two), in forward passes of at most `rows` rows (None: one pass;
    the last padded with empty rows, so every pass is one program)."""
    for rs in responses:
      if not 1 <= len(rs) <= samples or any(len(r) > budget for r in rs):
        raise ValueError(f"responses: expected 1 to {samples} of at most {budget} tokens, "
                         f"got {[len(r) for r in rs]}")
    if rows is not None and rows < len(prompts):
      p = max(_MIN_PROMPT, 1 << (max(map(len, prompts)) - 1).bit_length())
      out = []
      for at in range(0, len(prompts), rows):
        part = list(prompts[at:at + rows]), list(responses[at:at + rows])
        filled = len(part[0])
        part[0].extend([[0] * p] * (rows - filled))  # (the prompts' padded length kept)
        part[1].extend([[[]]] * (rows - filled))
        out += self.score_groups(*part, samples, budget)[:filled]
      return out
    rows = len(prompts)
    p = max(_MIN_PROMPT, 1 << (max(map(len, prompts)) - 1).bit_length())
    batch = {"prompt_tokens": np.zeros((rows, p), np.int32),
             "prompt_lens": np.asarray([len(x) for x in prompts], np.int32),
             "response_tokens": np.zeros((rows, samples, budget), np.int32),
             "response_lens": np.zeros((rows, samples), np.int32)}
    for i, (prompt, rs) in enumerate(zip(prompts, responses)):
      batch["prompt_tokens"][i, :len(prompt)] = prompt
      for j, r in enumerate(rs):
        batch["response_tokens"][i, j, :len(r)] = r
        batch["response_lens"][i, j] = len(r)
    out = jax.device_get(self.scores({k: jnp.asarray(v) for k, v in batch.items()}))
    keys = ("teacher_logp", "teacher_topk_ids", "teacher_topk_logp")
    return [[tuple(None if k not in out else np.asarray(out[k][i, j, :len(r)]) for k in keys)
             for j, r in enumerate(rs)] for i, rs in enumerate(responses)]


def own_tokenizer(path: str, policy_tokenizer: Any, field: str):
  """A teacher's own tokenizer (its folder's tokenizer.json, `field` naming the setting), with
  its chat template where the policy's prompts are rendered through one (and the policy's
  tokenizer.chat_kwargs and tokenizer.tools)."""
  from rlax_ps.tokenizers import HFTokenizer
  chat = "auto" if getattr(policy_tokenizer, "chat_template", None) else ""
  try:  # the policy's template arguments and tools: the teacher sees the prompt it saw
    return HFTokenizer(path, chat_template=chat,
                       chat_kwargs=getattr(policy_tokenizer, "chat_kwargs", None) if chat else None,
                       tools=getattr(policy_tokenizer, "tools", None) if chat else None)
  except (OSError, ValueError) as e:
    raise ValueError(f"{field}: {path!r}: {e}") from None


def score_retokenized(teacher, policy_tokenizer, teacher_tokenizer,
                      prompts: Sequence[Sequence[int]],
                      responses: Sequence[Sequence[Sequence[int]]],
                      weights: Sequence[Sequence[np.ndarray]],
                      stopped: Sequence[Sequence[bool]], samples: int,
                      observed: Sequence[Sequence[np.ndarray | None] | None] | None = None,
                      rows: int | None = None) -> list[list[np.ndarray]]:
  """A teacher of another tokenizer's log-probs of each policy token of each group's
  `responses` (teacher.tokenizer, worker.teacher_tokenizer): each response's text,
  tokenized for the teacher after its group's prompt (`prompts`: in the teacher's ids, its
  own chat template's rendering), is scored by `teacher` (score_groups: a packed row of
  `samples` slots a group); each smallest span of text both tokenize alike gets the
  teacher's log-prob of its tokens, shared out over the policy's tokens of the span in
  proportion to their `weights` (sampling log-probs), so a response's sum is the teacher's
  log-prob of its text. A response that ended on a stop token (`stopped`) gets for it the
  teacher's log-prob of the token that ends its turn there (turn_end_id). A multi-turn response's runs of tokens the policy
  drew and of an environment's replies (`observed`: True on the latter) are tokenized for
  the teacher run by run, so no span holds both: the replies' log-probs stay on the
  replies' tokens, which the loss leaves out. `rows`: score_groups' rows a forward pass."""
  from rlax_ps.token_alignment import aligned_chunks, decoded_pieces, spread_over_chunks
  observed = observed or [None] * len(responses)
  pieces, texts, spans = [], [], []  # spans: per response, each run's policy and teacher ends
  for rs, stops, obs in zip(responses, stopped, observed):
    pieces.append([]), texts.append([]), spans.append([])
    for r, stop, o in zip(rs, stops, obs or [None] * len(rs)):
      body = list(r[:len(r) - 1] if stop else r)
      pieces[-1].append(decoded_pieces(policy_tokenizer, body))
      ids, ends = [], []
      for a, b in _runs(None if o is None else np.asarray(o, bool)[:len(body)], len(body)):
        ids += teacher_tokenizer.encode("".join(pieces[-1][-1][a:b]))
        ends.append((b, len(ids)))
      texts[-1].append(ids + [teacher_tokenizer.turn_end_id] * int(stop))
      spans[-1].append(ends)
  budget = max(_MIN_PROMPT, 1 << (max(len(t) for ts in texts for t in ts) - 1).bit_length())
  scored = teacher.score_groups(prompts, texts, samples, budget, rows)
  out = []
  for group in zip(stopped, pieces, texts, scored, weights, spans):
    out.append([])
    for stop, own, ids, (logp, _, _), w, ends in zip(*group):
      n = len(ids) - int(stop)
      mine, theirs, count = [], [], 0
      start = begin = 0  # each run aligned alone: no span holds a turn's and a reply's text
      for end, stop_at in ends:
        read = decoded_pieces(teacher_tokenizer, ids[begin:stop_at])
        if "".join(read) != "".join(own[start:end]):  # aligned_chunks: the run is one span
          logging.log_every_n_seconds(
              logging.WARNING, "teacher: its tokenizer does not give back a response's text "
              "(%r reads as %r): the teacher scores what it read, shared out over the "
              "run's tokens", 60, "".join(own[start:end])[:80], "".join(read)[:80])
        a, b, k = aligned_chunks(own[start:end], read)
        mine.append(a + count), theirs.append(b + count)
        count, start, begin = count + k, end, stop_at
      spread = spread_over_chunks(logp[:n], np.concatenate(theirs), np.concatenate(mine),
                                  np.asarray(w, np.float64)[:len(own)], count)
      out[-1].append(np.concatenate([spread, logp[n:]]).astype(np.float32))
  return out


def _runs(observed: np.ndarray | None, n: int) -> list[tuple[int, int]]:
  """(start, end) of each run of `n` tokens alike in `observed` (None: one run)."""
  if observed is None or not n:
    return [(0, n)]
  cuts = np.flatnonzero(np.diff(observed.astype(np.int8))) + 1
  bounds = [0, *cuts.tolist(), n]
  return list(zip(bounds[:-1], bounds[1:]))
