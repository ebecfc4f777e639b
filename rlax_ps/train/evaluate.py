"""Held-out exact match: greedy decoding with the model's KV cache, scored by each task
(multi-turn with the workers' environment for the task, when the config names one).

Prompts are left-padded (padding has segment id 0, so no real token attends to it) and
every row's positions start at 0 at its first real token; decoding then writes one slot per
step for all rows at once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from algorithms.environments import environment_for
from algorithms.verifiers import REWARD_MODEL_TASK
from inference_workers.sampling import DecodeMode, SamplingParams, truncated_logprobs
from rlax_ps.models import KVCache
from rlax_ps.reward_scoring import prompt_messages
from rlax_ps.sharding import to_host
from rlax_ps.tasks import Example, Task
from rlax_ps.tokenizers import Tokenizer

# Sampling from the whole distribution at the temperature: no top-k, top-p or min-p.
UNTRUNCATED = DecodeMode(greedy=False, top_k=0, nucleus=False)


def greedy_generate(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array,
                    segment_ids: jax.Array, positions: jax.Array, *, max_new_tokens: int,
                    stop_ids: jax.Array, pad_id: int, mode: DecodeMode = UNTRUNCATED,
                    temperature=1.0, top_p=1.0, min_p=0.0, key=None) -> jax.Array:
  """[B, max_new_tokens] continuations of left-padded prompts: greedy, or with `key` (a key
  a row, [B, 2]) sampled as the workers sample (`mode`'s truncations at `temperature`,
  `top_p`, `min_p`: inference_workers.sampling), each row of its own key alone; after a
  row's first stop id (kept) the row is `pad_id`."""
  model = nnx.merge(graphdef, params)
  b, p = tokens.shape

  def choose(logits, step):
    if key is None:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    logp, ids = truncated_logprobs(logits.astype(jnp.float32), mode, t, top_p, min_p)
    pick = jax.vmap(lambda k, lp: jax.random.categorical(jax.random.fold_in(k, step), lp))(
        key, logp)
    if ids is not None:
      pick = jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]
    return pick.astype(jnp.int32)

  cache = KVCache.init(model.config, b, p + max_new_tokens)
  logits, cache = model(tokens, positions=positions, segment_ids=segment_ids, cache=cache)
  first = choose(logits[:, -1], 0)
  next_pos = jnp.max(positions, axis=1) + 1
  ones = jnp.ones((b, 1), jnp.int32)

  def body(carry, step):
    tok, pos, done, cache = carry
    out = jnp.where(done, pad_id, tok)
    done = done | jnp.isin(tok, stop_ids)
    logits, cache = model(tok[:, None], positions=pos[:, None], segment_ids=ones, cache=cache)
    return (choose(logits[:, 0], step), pos + 1, done, cache), out

  init = (first, next_pos, jnp.zeros((b,), bool), cache)
  _, outs = jax.lax.scan(body, init, jnp.arange(1, max_new_tokens + 1))
  return outs.T


@functools.lru_cache(maxsize=8)
def jitted_generate(graphdef: nnx.GraphDef, max_new_tokens: int,
                    mode: DecodeMode | None = None, mesh: jax.sharding.Mesh | None = None):
  """jit(greedy_generate) for one model and budget:
  f(params, tokens, segment_ids, positions, stop_ids, pad_id) -> [B, max_new_tokens], or
  sampled with a `mode` (its truncations compiled in),
  f(..., pad_id, temperature, top_p, min_p, keys [B, 2]). `mesh`: the params' (traced in its
  context, as the train step is: expert parallelism runs there too)."""
  def generate(params, tokens, segment_ids, positions, stop_ids, pad_id, temperature=1.0,
               top_p=1.0, min_p=0.0, key=None):
    with (contextlib.nullcontext() if mesh is None
          else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
      return greedy_generate(graphdef, params, tokens, segment_ids, positions,
                             max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                             mode=mode, temperature=temperature, top_p=top_p, min_p=min_p,
                             key=key)

  if mode is not None:
    return jax.jit(generate)
  return jax.jit(lambda params, tokens, segment_ids, positions, stop_ids, pad_id: generate(
      params, tokens, segment_ids, positions, stop_ids, pad_id))


def sampling_mode(temperature: float, top_k: int, top_p: float, min_p: float
                  ) -> DecodeMode | None:
  """The compiled-in part of the workers' sampling settings (SamplingParams checks them);
  None: greedy (temperature 0)."""
  mode = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).mode
  return None if mode.greedy else mode


def left_pad_prompts(tokenizer: Tokenizer, prompts: Sequence[str], length: int
                     ) -> dict[str, np.ndarray]:
  """Prompt ids (`encode_prompt`), right-aligned in rows of `length`, with segment ids and
  positions."""
  return left_pad_ids([tokenizer.encode_prompt(p) for p in prompts], length, tokenizer.pad_id,
                      prompts)


def left_pad_ids(rows: Sequence[Sequence[int]], length: int, pad_id: int,
                 names: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
  """Token id rows right-aligned in rows of `length`, with segment ids and positions."""
  b = len(rows)
  tokens = np.full((b, length), pad_id, np.int32)
  seg = np.zeros((b, length), np.int32)
  pos = np.zeros((b, length), np.int32)
  for i, ids in enumerate(rows):
    if len(ids) > length:
      name = rows[i] if names is None else names[i]
      raise ValueError(f"prompt {name!r} has {len(ids)} tokens, more than length={length}")
    tokens[i, length - len(ids):] = ids
    seg[i, length - len(ids):] = 1
    pos[i, length - len(ids):] = np.arange(len(ids))
  return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def _decode_batches(graphdef, params, tokenizer: Tokenizer, rows: Sequence[Sequence[int]], *,
                    max_new_tokens: int, batch_size: int, prompt_len: int,
                    mode: DecodeMode | None, draw: tuple[float, float, float], key,
                    row_ids: Sequence[int]) -> list[list[int]]:
  """Each id row's continuation up to and including its first stop id (or the budget),
  `batch_size` rows per call: greedy, or with a `mode` sampled at `draw` (temperature, top_p,
  min_p), row j with fold_in(key, row_ids[j]): the same whatever the batch size."""
  mesh = getattr(getattr(jax.tree.leaves(params)[0], "sharding", None), "mesh", None)
  gen = jitted_generate(graphdef, max_new_tokens, mode,
                        mesh if isinstance(mesh, jax.sharding.Mesh) else None)
  stops = np.asarray(tokenizer.stop_ids, np.int32)
  extra = ()
  out: list[list[int]] = []
  for start in range(0, len(rows), batch_size):
    chunk = list(rows[start:start + batch_size])
    n = len(chunk)
    chunk += [chunk[-1]] * (batch_size - n)  # Keep one shape: one compile.
    arrays = left_pad_ids(chunk, prompt_len, tokenizer.pad_id)
    if mode is not None:
      which = list(row_ids[start:start + n])
      which += [which[-1]] * (batch_size - n)
      extra = (*map(np.float32, draw), _row_keys(key, np.asarray(which, np.uint32)))
    ids = np.asarray(to_host(gen(params, arrays["tokens"], arrays["segment_ids"],
                                        arrays["positions"], stops, tokenizer.pad_id,
                                        *extra)))
    for row in ids[:n]:
      row = [int(t) for t in row]
      ends = [i for i, t in enumerate(row) if t in tokenizer.stop_ids]
      out.append(row[:ends[0] + 1] if ends else row)
  return out


@jax.jit
def _row_keys(key, row_ids):
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(row_ids)


def completions(graphdef, params, tokenizer: Tokenizer, prompts: Sequence[str],
                **kwargs) -> list[str]:
  """Completion text of each prompt (up to eos, which is left out): completion_ids'."""
  return [completion_text(tokenizer, t)
          for t in completion_ids(graphdef, params, tokenizer, prompts, **kwargs)]


def completion_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
  """A completion's text: its ids decoded, the stop token that ended it left out."""
  return tokenizer.decode(ids[:-1] if len(ids) and ids[-1] in tokenizer.stop_ids else ids)


def completion_ids(graphdef, params, tokenizer: Tokenizer, prompts: Sequence[str], *,
                   max_new_tokens: int, batch_size: int, prompt_len: int,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, seed: int = 0, environment=None,
                   references: Sequence[Any] = (), max_turns: int = 0) -> list[list[int]]:
  """Completion ids of each prompt (up to and with the stop token that ended it, as a worker
  submits them), `batch_size` prompts per call: greedy, or sampled at `temperature` > 0
  with the workers' top_k, top_p and min_p (SamplingParams; prompt i drawn with key
  fold_in(key(seed), i): the same samples whatever `batch_size`).

  Multi-turn (`environment`, as the workers run it): each turn a completion ends is
  answered by environment(the conversation so far, references[i]) up to `max_turns` times;
  the reply joins it (`encode_reply`) and decoding goes on from the whole of it, within
  `max_new_tokens` in all."""
  from algorithms.environments import conversation, turn_text
  key = jax.random.PRNGKey(seed)
  mode = sampling_mode(temperature, top_k, top_p, min_p)
  ids = [tokenizer.encode_prompt(p) for p in prompts]
  said: list[list[int]] = [[] for _ in prompts]
  turns: list[list[str]] = [[] for _ in prompts]  # multi-turn: each policy turn's text
  replies: list[list[Any]] = [[] for _ in prompts]
  live = list(range(len(prompts)))
  for turn in range(max_turns + 1 if environment is not None else 1):
    rows = [ids[i] + said[i] for i in live]
    length = prompt_len if turn == 0 else max(prompt_len, 1 << (max(map(len, rows)) - 1)
                                              .bit_length())
    got = _decode_batches(graphdef, params, tokenizer, rows, max_new_tokens=max_new_tokens,
                          batch_size=batch_size, prompt_len=length, mode=mode,
                          draw=(temperature, top_p, min_p),
                          key=jax.random.fold_in(key, turn) if turn else key, row_ids=live)
    going = []
    for i, new in zip(live, got):
      new = new[:max_new_tokens - len(said[i])]
      said[i] += new
      if (environment is None or turn == max_turns or len(said[i]) >= max_new_tokens
          or said[i][-1] not in tokenizer.stop_ids):
        continue
      turns[i].append(turn_text(tokenizer, new))
      try:
        reply = environment(conversation(turns[i], replies[i]), references[i])
      except TypeError as e:  # a reply of no usable type: its sample ends, as in the workers
        logging.log_every_n_seconds(logging.WARNING, "evaluate: %s; the completion ends", 30, e)
        continue
      if reply is None:
        continue
      fed = tokenizer.encode_reply(reply, said[i][-1])
      if fed:
        replies[i].append(reply)
        said[i] += fed[:max_new_tokens - len(said[i])]
        going.append(i)
    live = [i for i in going if len(said[i]) < max_new_tokens]
    if not live:
      break
  return said


class VerifierTask:
  """A task name scored by its verifier (a built-in task's checker or a registered one),
  for held-out records read from a file: what exact_match and pass_at_k use of a Task.
  reward is 1.0 when the verifier says the completion passed."""

  def __init__(self, name: str, field: str = "task"):
    from algorithms.verifiers import verifier_for_task
    self.name, self._verifier = name, verifier_for_task(name, field)
    self.errors = 0  # completions scored 0 because the verifier raised

  def reward(self, example: Example, completion: str) -> float:
    result = self._verifier(completion, example.answer)
    if "error" in result.info:
      self.errors += 1
      if self.errors <= 5:
        logging.warning("eval: verifier of task %r raised (scored 0): %s", self.name,
                        result.info["error"])
    return float(result.passed)


class RewardModelTask:
  """Held-out prompts of task reward_model: a completion's reward is the reward model's score
  of the conversation, the prompt's messages then the completion as the assistant's turn
  (read as `scorer.encode` does; where it shares the policy's ids, the prompt's ids and the
  completion's, its stop token too, as the workers score it). Scored in batches (`rewards`);
  a score, not pass/fail."""

  name = REWARD_MODEL_TASK

  def __init__(self, scorer, tokenizer: Tokenizer):
    self.scorer, self.tokenizer = scorer, tokenizer

  def rewards(self, examples: Sequence[Example], completions: Sequence[Sequence[int]]
              ) -> list[float]:
    tok, sequences = self.tokenizer, []
    for e, ids in zip(examples, completions):
      text = completion_text(tok, ids)
      sequences.append(self.scorer.encode(
          prompt_messages(e.prompt, {}) + [{"role": "assistant", "content": text}],
          tok.render_prompt(e.prompt), text, tok.encode_prompt(e.prompt) + list(ids)))
    return [float(r) for r in self.scorer.scores(sequences)]


def rewards_of(task, tokenizer: Tokenizer, examples: Sequence[Example],
               completions: Sequence[Sequence[int]]) -> list[float]:
  """Each completion's reward (completions as ids, completion_ids'): in one batch where the
  task scores batches (a reward model), else one by one, of its text."""
  if hasattr(task, "rewards"):
    return task.rewards(examples, completions)
  return [float(task.reward(e, completion_text(tokenizer, c)))
          for e, c in zip(examples, completions)]


def _budgets(tokenizer: Tokenizer, examples: dict[str, list[Example]],
             max_new_tokens: int | None = None) -> tuple[int, int]:
  """(prompt length, new-token budget) that fit every example: the budget is the longest
  answer and eos unless `max_new_tokens` is given (answers a model reasons its way to)."""
  prompt_len = max(len(tokenizer.encode_prompt(e.prompt))
                   for exs in examples.values() for e in exs)
  if max_new_tokens:
    return prompt_len, int(max_new_tokens)
  max_new = max(len(tokenizer.encode(e.answer)) for exs in examples.values() for e in exs) + 1
  return prompt_len, max_new


def pass_at_k(graphdef, params, tokenizer: Tokenizer, tasks: Sequence[Task],
              examples: dict[str, list[Example]], *, k: int, temperature: float = 1.0,
              top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
              batch_size: int = 256, max_new_tokens: int | None = None,
              environments: dict | None = None, max_turns: int = 0) -> dict[str, float]:
  """{"pass@1": mean reward of k samples per prompt, "pass@k": mean of each prompt's best
  reward among its k samples (pass/fail tasks: the share of prompts with at least one exact
  answer; a reward model's: its best-of-k score)}, over every held-out example, the samples
  drawn at `temperature` with `top_k`, `top_p` and `min_p` as a worker draws them.
  `max_new_tokens`: the decoding budget (default: the longest answer and eos);
  `environments` (by task: algorithms.environments.environments_from), `max_turns`:
  multi-turn, as `completions`; the tasks of each environment decode in one call (seed + its
  index)."""
  if k < 1 or temperature <= 0:
    raise ValueError(f"pass_at_k: expected k >= 1 and temperature > 0, got k={k}, "
                     f"temperature={temperature}")
  by_name = {t.name: t for t in tasks}
  flat = [(by_name[name], e) for name, exs in examples.items() for e in exs]
  if not flat:
    return {"pass@1": 0.0, f"pass@{k}": 0.0}
  prompt_len, max_new = _budgets(tokenizer, examples, max_new_tokens)
  said: list[list[int]] = [[] for _ in range(len(flat) * k)]
  calls: dict[int, tuple[Any, list[int]]] = {}  # environment (by id) -> its example indices
  for i, (task, _) in enumerate(flat):
    env = environment_for(environments or {}, task.name)
    calls.setdefault(id(env), (env, []))[1].append(i)
  for g, (env, rows) in enumerate(calls.values()):
    got = completion_ids(graphdef, params, tokenizer,
                         [flat[i][1].prompt for i in rows for _ in range(k)],
                         max_new_tokens=max_new, batch_size=batch_size, prompt_len=prompt_len,
                         temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         seed=seed + g, environment=env,
                         references=[flat[i][1].answer for i in rows for _ in range(k)],
                         max_turns=max_turns)
    for n, i in enumerate(rows):
      said[i * k:(i + 1) * k] = got[n * k:(n + 1) * k]
  rewards = np.zeros((len(flat), k))
  for task in tasks:
    rows = [i for i, (t, _) in enumerate(flat) if t is task]
    got = rewards_of(task, tokenizer, [flat[i][1] for i in rows for _ in range(k)],
                     [said[i * k + j] for i in rows for j in range(k)])
    rewards[rows] = np.asarray(got, np.float64).reshape(len(rows), k)
  return {"pass@1": float(rewards.mean()), f"pass@{k}": float(rewards.max(axis=1).mean())}


def exact_match(graphdef, params, tokenizer: Tokenizer, tasks: Sequence[Task],
                examples: dict[str, list[Example]], *, batch_size: int,
                max_new_tokens: int | None = None, environments: dict | None = None,
                max_turns: int = 0) -> dict[str, float]:
  """{task name: held-out exact-match rate (a reward model's task: its mean score), "all":
  the mean over every example}; `max_new_tokens`, `environments` and `max_turns` as
  pass_at_k's."""
  prompt_len, max_new = _budgets(tokenizer, examples, max_new_tokens)
  result, hits, total = {}, 0.0, 0
  for task in tasks:
    exs = examples.get(task.name, [])
    if not exs:
      continue
    said = completion_ids(graphdef, params, tokenizer, [e.prompt for e in exs],
                          max_new_tokens=max_new, batch_size=batch_size, prompt_len=prompt_len,
                          environment=environment_for(environments or {}, task.name),
                          references=[e.answer for e in exs], max_turns=max_turns)
    rewards = rewards_of(task, tokenizer, exs, said)
    result[task.name] = float(np.mean(rewards))
    hits += sum(rewards)
    total += len(exs)
  result["all"] = hits / max(total, 1)
  return result
