"""The checks of an RL config that need no model, devices or server: the trainer runs them
first, and `rlax-ps local` before its warm start, so a wrong field fails in seconds with
its name rather than minutes later in a child."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator

from absl import logging

from algorithms.selection import check_revisit
from rlax_ps import optim
from rlax_ps.config_files import check_counts
from rlax_ps.sharding import check_mesh_axes
from rlax_ps.sync.wire import FORMATS
from rlax_ps.train.critic import check_critic_config
from rlax_ps.train.rl_loss import LossConfig, check_micro_batches, ref_sync_settings

# What an RL trainer does with a data source other than its checkpoint's, under
# data.allow_new_source (run.resumed_source_line's `switch`).
NEW_SOURCE_FED = ("the run feeds this data from its first record (prompts of the old data "
                  "still queued at the server are trained on too)")


def check_rl_config(config, *, files: bool = True) -> LossConfig:
  """ValueError naming the field unless the config's `rl`, `loss`, `publish`, `worker` and `log`
  settings fit together; returns the loss settings (budget: worker.max_new_tokens). With
  `files`, also reads the prompt files and verifier modules the config names (and the
  tokenizer of init_from_hf): what the trainer and workers would refuse at their start."""
  rl, worker = config.rl, config.worker
  steps, staleness, every = int(rl.steps), int(rl.max_staleness), int(rl.publish_every)
  if steps < 1 or staleness < 0 or every < 1:
    raise ValueError(f"rl: expected steps >= 1, max_staleness >= 0, publish_every >= 1, got "
                     f"{steps}, {staleness}, {every}")
  if int(rl.groups_per_step) < 1:
    raise ValueError(f"rl.groups_per_step: expected >= 1, got {rl.groups_per_step}")
  seconds = rl.get("max_seconds", 0.0)
  if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
    raise ValueError(f"rl.max_seconds: expected seconds >= 0 (0: no limit), got {seconds!r}")
  deadline = rl.get("ack_deadline_s", 1800.0)
  if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not (
      0 < deadline < float("inf")):
    raise ValueError(f"rl.ack_deadline_s: expected seconds > 0 (at most the server's "
                     f"max_lease_deadline_s, 3600 by default), got {deadline!r}")
  patience = rl.get("take_timeout_s", 600.0)
  if isinstance(patience, bool) or not isinstance(patience, (int, float)) or not (
      0 < patience < float("inf")):
    raise ValueError(f"rl.take_timeout_s: expected seconds > 0 (how long the trainer waits for "
                     f"a group it can train on before it ends the run), got {patience!r}")
  check_counts(config, ("checkpoint.every_steps", "eval.every_steps", "export.every_steps",
                        "export.max_to_keep"))
  check_run_blocks(config, steps)
  temperature = worker.get("temperature", 1.0)
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
      0 < temperature < float("inf")):
    raise ValueError(f"worker.temperature: expected > 0 for RL (a group's samples must differ; "
                     f"the trainer scores the distribution they are drawn from), got "
                     f"{temperature!r}")
  updates = int(rl.get("updates_per_batch", 1))
  if updates < 1:
    raise ValueError(f"rl.updates_per_batch: expected >= 1, got {updates}")
  if int(rl.get("response_buckets", 1)) < 1:
    raise ValueError(f"rl.response_buckets: expected >= 1, got {rl.response_buckets}")
  # M2PO's unread clip bounds, in the block as given (LossConfig fills in PPO's).
  if str(config.loss.get("correction", "none")) == "m2po":
    for field in ("clip_low", "clip_high"):
      if config.loss.get(field) is not None:
        raise ValueError(f"loss.{field}: expected unset with loss.correction='m2po' (M2PO "
                         f"clips no ratio: tokens past m2po_threshold are masked instead), "
                         f"got {config.loss.get(field)!r}")
  loss = dataclasses.replace(LossConfig.from_config(config.loss),
                             budget=int(worker.max_new_tokens),
                             temperature=float(worker.temperature))
  if loss.reward_aggregation == "normalize_then_sum":
    parts = reward_part_weights(worker)
    if not parts:
      raise ValueError("loss.reward_aggregation: expected 'sum' when the workers send no "
                       "reward parts (worker.reward_terms and worker.reward_model unset), got "
                       "'normalize_then_sum'")
    loss = dataclasses.replace(loss, reward_parts=parts)
  check_micro_batches(int(rl.get("micro_batches", 1)), int(rl.groups_per_step), loss)
  if loss.advantage == "gae":  # its critic's block (absent: the optimizer block's defaults)
    check_critic_config(config.get("critic") or {}, steps)
  if loss.policy_loss == "pg" and updates > 1:
    raise ValueError(f"rl.updates_per_batch: expected 1 with loss.policy_loss='pg' (the plain "
                     f"policy gradient takes no ratio: each later update repeated the first's "
                     f"on-policy step on rollouts the first made off-policy), got {updates}")
  if loss.adaptive_entropy and updates > 1:
    raise ValueError(f"rl.updates_per_batch: expected 1 with loss.adaptive_entropy=True (the "
                     f"coefficient adapts after each update from its entropy, as TRL's; a "
                     f"batch's updates run as one step), got {updates}")
  ref_sync_settings(rl, loss, int(config.model.get("lora_rank", 0)))
  teacher = str((config.get("teacher") or {}).get("path", ""))
  distilling = loss.advantage == "opd" or loss.distill_topk > 0
  on_workers = str(worker.get("teacher", ""))
  own = str((config.get("teacher") or {}).get("tokenizer", ""))
  if own and (not teacher or loss.distill_topk):
    raise ValueError(f"teacher.tokenizer: expected '' without teacher.path or with "
                     f"loss.distill_topk > 0 (the teacher's top tokens are ids of its own "
                     f"vocabulary), got {own!r} with teacher.path={teacher!r}, "
                     f"loss.distill_topk={loss.distill_topk}")
  if on_workers:  # the teacher scores each group on the workers instead
    if teacher or not distilling:
      raise ValueError(f"worker.teacher: expected '' with teacher.path set (the teacher sits on "
                       f"the trainer or on the workers) or without loss.advantage='opd' or "
                       f"loss.distill_topk > 0, got {on_workers!r} with teacher.path="
                       f"{teacher!r}, loss.advantage={loss.advantage!r}")
    if worker.get("teacher_tokenizer", "") and loss.distill_topk:
      raise ValueError(f"loss.distill_topk: expected 0 with worker.teacher_tokenizer (the "
                       f"teacher's top tokens are ids of its own vocabulary), got "
                       f"{loss.distill_topk}")
    if int(worker.get("teacher_topk", 0)) != loss.distill_topk:
      raise ValueError(f"worker.teacher_topk: expected loss.distill_topk="
                       f"{loss.distill_topk} (the top tokens the loss takes), got "
                       f"{worker.get('teacher_topk', 0)}")
  elif distilling != bool(teacher):
    raise ValueError(f"teacher.path: expected an HF checkpoint folder with loss.advantage="
                     f"'opd' or loss.distill_topk > 0 (or worker.teacher: the teacher on the "
                     f"workers) and none without, got {teacher!r} with "
                     f"loss.advantage={loss.advantage!r}, loss.distill_topk="
                     f"{loss.distill_topk}")
  greedy = bool(worker.get("greedy_baseline", False))
  if (loss.advantage == "remax") != greedy:
    raise ValueError(f"worker.greedy_baseline: expected True with loss.advantage='remax' (its "
                     f"baseline is each prompt's greedy sample's reward) and False without "
                     f"(the greedy samples would go unused), got {greedy} with "
                     f"loss.advantage={loss.advantage!r}")
  samples, allocator = int(worker.samples_per_prompt), str(worker.get("allocator", "fixed"))
  if config.eval.get("on_workers", False) and allocator != "fixed":
    raise ValueError(f"eval.on_workers: needs worker.allocator='fixed' (VIGOR's rounds give "
                     f"every prompt its share of samples), got {allocator!r}")
  if config.eval.get("on_workers", False) and int(config.eval.get("pass_k", 0)) > samples:
    raise ValueError(f"eval.pass_k: expected at most worker.samples_per_prompt={samples} with "
                     f"eval.on_workers (the workers sample the final pass@k), got "
                     f"{config.eval.pass_k}")
  pass_k = config.eval.get("rounds_pass_k", 0)
  if pass_k and not config.eval.get("on_workers", False):
    raise ValueError(f"eval.rounds_pass_k: expected 0 without eval.on_workers (the workers "
                     f"sample the rounds' answers), got {pass_k!r}")
  if not (isinstance(pass_k, int) and 0 <= pass_k <= samples):
    raise ValueError(f"eval.rounds_pass_k: expected an int from 0 to worker.samples_per_prompt="
                     f"{samples} (the samples a worker decodes of a prompt), got {pass_k!r}")
  if allocator == "fixed" and samples < 2 and loss.advantage not in ("opd", "remax"):
    raise ValueError(f"worker.samples_per_prompt: loss.advantage={loss.advantage!r} weighs "
                     f"each sample against the others of its group; expected >= 2, got "
                     f"{samples} (every advantage would be 0)")
  if rl.get("dynamic_sampling", False):
    if loss.advantage == "remax":
      raise ValueError("rl.dynamic_sampling: expected False with loss.advantage='remax': a "
                       "group of equal rewards learns there (against its greedy answer's "
                       "reward), and DAPO's filter would leave it out")
    if allocator != "fixed":
      raise ValueError(f"rl.dynamic_sampling: needs worker.allocator='fixed' (VIGOR already "
                       f"spends samples where rewards vary), got {allocator!r}")
    factor = float(rl.get("dynamic_sampling_max_factor", 3.0))
    if not factor >= 1.0:
      raise ValueError(f"rl.dynamic_sampling_max_factor: expected >= 1, got {factor}")
  if str(config.publish.format) not in FORMATS:
    raise ValueError(f"publish.format: expected one of {FORMATS} (worker.weights_format the "
                     f"same), got {config.publish.format!r}")
  if str(worker.weights_format) != str(config.publish.format):
    raise ValueError(f"worker.weights_format: expected publish.format="
                     f"{config.publish.format!r} (the format the workers pull), got "
                     f"{worker.weights_format!r}")
  if "retire_solved" in rl:
    raise ValueError("rl.retire_solved: replaced by rl.revisit_solved (0.0: a solved record "
                     "is not fed again)")
  revisit = (check_revisit("rl.revisit_solved", rl.get("revisit_solved", 1.0)),
             check_revisit("rl.revisit_failed", rl.get("revisit_failed", 1.0)))
  if revisit != (1.0, 1.0) and loss.advantage == "remax":
    raise ValueError("rl.revisit_solved, rl.revisit_failed: expected 1.0 with loss.advantage="
                     "'remax': a group of equal rewards learns there (against its greedy "
                     "answer's reward), and revisiting sets it aside as learning nothing")
  from rlax_ps.train.prompts import file_weights  # (grain: on use)
  file_weights(config.data)  # data.weights: one a file of data.jsonl
  if revisit != (1.0, 1.0) and not config.data.get("jsonl", ""):
    raise ValueError("rl.revisit_solved, rl.revisit_failed: expected data.jsonl (the "
                     "built-in tasks' stream never repeats a prompt), got none")
  log = config.get("log") or {}  # the completions log
  for key in ("completions_every", "completions_groups"):
    value = log.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"log.{key}: expected a whole number >= 0, got {value!r}")
  if log.get("completions_every", 0) and not log.get("completions_groups", 0):
    raise ValueError(f"log.completions_groups: expected >= 1 while log.completions_every="
                     f"{log['completions_every']} logs completions (0 turns the log off), got 0")
  if "tasks" in config:  # (a recipe for your own data names none: data.jsonl it needs)
    from rlax_ps.train.run import tasks_from
    tasks_from(config.tasks, config.get("data", {}).get("jsonl", ""))
  if files:
    _check_files(config)
  return loss


def check_run_blocks(config, steps: int) -> None:
  """The blocks the trainer reads only once started (optimizer, checkpoint, eval, mesh),
  checked before anything starts: ValueError naming the field."""
  for block in ("optimizer", "critic.optimizer"):
    opt = config.get("optimizer") if block == "optimizer" else (
        (config.get("critic") or {}).get("optimizer"))
    if opt is None:
      continue
    if block == "optimizer":  # (the critic's block names itself: check_critic_config)
      optim.check_optimizer_config(opt, steps)
    if int(optim.setting(opt, "grad_accum_steps")) != 1:
      raise ValueError(f"{block}.grad_accum_steps: expected 1 in RL, got "
                       f"{optim.setting(opt, 'grad_accum_steps')!r}; rl.micro_batches splits "
                       f"an RL step's batch")
  keep = (config.get("checkpoint") or {}).get("max_to_keep", 1)
  if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
    raise ValueError(f"checkpoint.max_to_keep: expected >= 1, got {keep!r}")
  size = (config.get("eval") or {}).get("batch_size", 1)
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ValueError(f"eval.batch_size: expected >= 1, got {size!r}")
  if config.get("mesh") is not None:
    check_mesh_axes(dict(config.mesh))


def reward_part_weights(worker) -> tuple[tuple[str, float], ...]:
  """The reward parts the workers send, by name, with the weights their reward sums them
  with (inference_workers.loop's _scored): the task verifier's 1, each worker.reward_terms
  term's own, the reward model's worker.reward_model_weight; () when they send none."""
  from inference_workers.worker_config import WorkerConfig
  terms = WorkerConfig(reward_terms=str(worker.get("reward_terms", ""))).reward_term_weights()
  scorer = bool(str(worker.get("reward_model", "")))
  if not terms and not scorer:
    return ()
  rm = [("reward_model", float(worker.get("reward_model_weight", 0.0)))] if scorer else []
  return (("task", 1.0), *terms, *rm)


def _check_files(config) -> None:
  """The verifiers, environments, prompt files and tokenizer the config names load and hold
  what the trainer and workers expect of them: each task of the records gets its verifier
  made now (a worker makes it at the first prompt of that task); the prompts, the built-in
  tasks' too, fit the prompt limit."""
  from algorithms.environments import environment_names, environments_from
  from algorithms.verifiers import (REWARD_MODEL_TASK, known_tasks, verifier_for_task,
                                    verifiers_by_task)
  from rlax_ps.tokenizers import tokenizer_file, tokenizer_from_config
  from rlax_ps.train.prompts import heldout_overlap, iter_config_records
  worker = config.worker
  verifiers_by_task(str(worker.default_task), str(worker.get("verifiers", "")))
  from rlax_ps.train.run import check_init_from_hf
  tokenizer, block = None, config.get("tokenizer") or {}
  start = str(config.get("init_from_hf", ""))
  model = check_init_from_hf(start) if start else None  # first: a mistyped folder is named
  if start or str(block.get("kind", "char")) == "char":
    try:
      tokenizer = tokenizer_from_config(block, start,
                                        tool_modules=str(worker.get("verifiers", "")))
    except (ValueError, FileNotFoundError) as e:
      if not start or str(block.get("kind", "char")) == "char" or block.get("path", ""):
        raise
      raise ValueError(f"tokenizer.path: unset, so the tokenizer of init_from_hf's folder, "
                       f"which has none: {e}") from None
  if model is not None and tokenizer.vocab_size > model.vocab_size:  # (its ids clamped)
    raise ValueError(f"init_from_hf: {start}: config.json vocab_size: expected at least "
                     f"{tokenizer.vocab_size} (the tokenizer's ids), got {model.vocab_size}")
  for field, teacher in (("teacher.path", (config.get("teacher") or {}).get("path", "")),
                         ("worker.teacher", worker.get("teacher", ""))):
    if str(teacher):
      try:
        check_init_from_hf(str(teacher))
      except ValueError as e:
        raise ValueError(f"{field}: {str(e).removeprefix('init_from_hf: ')}") from None
  reward_model = str(worker.get("reward_model", ""))
  if reward_model:
    _check_reward_model(reward_model)
  from inference_workers.worker_config import WorkerConfig
  for name, _ in WorkerConfig(reward_terms=str(worker.get("reward_terms", ""))
                              ).reward_term_weights():  # (worker.verifiers imported above)
    verifier_for_task(name.removeprefix("task:"), "worker.reward_terms")
  own = str((config.get("teacher") or {}).get("tokenizer", ""))
  if own and not tokenizer_file(own):
    raise ValueError(f"teacher.tokenizer: expected a folder with the teacher's tokenizer.json "
                     f"(or tiktoken.model), got {own!r}")
  limit, bound = (prompt_limit(config, model.max_position_embeddings) if model is not None
                  else (int(config.rl.max_prompt_tokens), "rl.max_prompt_tokens"))
  if tokenizer is not None and not config.data.get("jsonl", "") and "tasks" in config:
    from rlax_ps.train.run import tasks_from  # the built-in tasks' prompts, as the trainer's
    check_task_prompts(*tasks_from(config.tasks), tokenizer, limit, bound)
  heldout = config.data.get("heldout_jsonl", "")
  held = [r["prompt"] for r in iter_config_records(config, "data.heldout_jsonl", heldout)
          ] if heldout and config.data.get("jsonl", "") else []
  for field in ("jsonl", "heldout_jsonl"):
    path = config.data.get(field, "")
    if path:
      records = iter_config_records(config, f"data.{field}", path)
      if held and field == "jsonl":
        records, seen = _prompts_seen(records, held)
      if tokenizer is None:
        tasks = {r["task"] for r in records}
      else:
        tasks, digest = _tasks_and_digest(config, records)
        check_prompt_lengths(config, f"data.{field}", path, digest, tokenizer,
                             *((limit, bound) if field == "jsonl" else (None, "")))
      for task in sorted(tasks - {REWARD_MODEL_TASK, str(worker.default_task)}):
        verifier_for_task(task, f"data.{field} task")
      if held and field == "jsonl":
        line = heldout_overlap(held, seen)
        if line:
          logging.warning("%s", line)
  spec = str(worker.get("environment", ""))
  unknown = sorted(set(environment_names(spec)) - {"*"} - set(known_tasks()))
  if unknown:
    raise ValueError(f"worker.environment: expected tasks among {known_tasks()} (worker.verifiers "
                     f"registers more), got {unknown} in {spec!r}; their prompts would be "
                     f"single-turn")
  environments_from(spec, worker.get("environment_args", ""))


def _check_reward_model(path: str) -> None:
  """worker.reward_model's config.json names a sequence classifier the workers can load (its
  weights are read by the workers alone)."""
  from rlax_ps.models.hf import CONFIG_FILE, read_json
  from rlax_ps.models.reward_model import reward_config
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise ValueError(f"worker.reward_model: no {CONFIG_FILE} in reward model folder {path!r}")
  try:
    reward_config(read_json(file))
  except (OSError, ValueError) as e:
    raise ValueError(f"worker.reward_model: {path}: {e}") from None


def _prompts_seen(records, held: list) -> tuple[Iterator[dict], list]:
  """(the records, passed through; the list their prompts among `held` are put in as they go
  by: a large file's are not kept)."""
  from rlax_ps.train.prompts import prompt_key
  keys, seen = {prompt_key(p) for p in held}, []

  def each():
    for record in records:
      if prompt_key(record["prompt"]) in keys:
        seen.append(record["prompt"])
      yield record

  return each(), seen


def _tasks_and_digest(config, records) -> tuple[set[str], str]:
  """The tasks of a stream of records and their digest (data_source's), in one pass."""
  from rlax_ps.train.run import data_source  # orbax and the trainer's helpers: on use
  tasks = set()

  def read():
    for record in records:
      tasks.add(record["task"])
      yield record["prompt"], record["answer"], record["task"]

  return tasks, data_source(config, read())["digest"]


def check_prompt(tokenizer, limit: int | None, record: dict,
                 field: str = "rl.max_prompt_tokens") -> int:
  """The number of tokens the record's prompt encodes into (its characters in the tokenizer,
  messages under a chat template); ValueError naming the setting `field` when that is more
  than `limit` (when given): the trainer refuses any other at its start."""
  ids = tokenizer.encode_prompt(record["prompt"])
  if limit is not None and len(ids) > limit:
    raise ValueError(f"{field}: {limit} is too small for this prompt of {len(ids)} tokens; "
                     f"raise it or shorten the prompt")
  return len(ids)


# Where check_prompt_lengths keeps what it found: RLAX_PS_PROMPT_CHECKS moves it, '' turns
# it off.
PROMPT_CHECKS_DIR = os.path.join("~", ".cache", "rlax_ps", "prompt_checks")


def check_task_prompts(tasks, weights, tokenizer, limit: int, bound: str) -> None:
  """ValueError naming `bound` where the longest prompt a built-in task of weight > 0 can
  give (a character is at most one token of their text, beside what the tokenizer adds
  around a prompt) may exceed `limit` tokens: found now, not at the first long prompt drawn
  after the server, the workers and the compiles have started."""
  around = len(tokenizer.encode_prompt(""))
  for task, weight in zip(tasks, weights):
    longest = task.max_prompt_chars + around
    if weight > 0 and longest > limit:
      raise ValueError(f"{bound}: {limit} tokens may not hold the prompts of task "
                       f"{task.name!r} (up to {longest}); allow longer prompts, or set the "
                       f"task's tasks.{task.name}.* for shorter ones")


def check_prompt_lengths(config, field: str, path: str, digest: str, tokenizer,
                         limit: int | None, bound: str = "rl.max_prompt_tokens") -> None:
  """check_prompt of each record of the prompt file `path` (the config's `field`), the
  first one refused named by its file and line, unless a check of the same records (their
  `digest`, data_source's) with the same tokenizer found every prompt within `limit` tokens:
  the longest prompt found is kept for the next check (`rlax-ps local`'s, then its
  trainer's, or a restarted trainer's), so a large file is tokenized once."""
  cached = _prompt_check_file(digest, tokenizer)
  longest = _read_longest(cached)
  if longest is not None and (limit is None or longest <= limit):
    return
  longest = 0

  def check(record: dict) -> None:
    nonlocal longest
    longest = max(longest, check_prompt(tokenizer, limit, record, bound))

  from rlax_ps.train.prompts import iter_config_records
  collections.deque(iter_config_records(config, field, path, check), maxlen=0)  # check each
  if cached is not None:
    _write_longest(cached, longest)


def _prompt_check_file(digest: str, tokenizer) -> str | None:
  """The file of check_prompt_lengths' result for these records and this tokenizer (None:
  not kept, for a tokenizer without a fingerprint or with RLAX_PS_PROMPT_CHECKS='')."""
  directory = os.environ.get("RLAX_PS_PROMPT_CHECKS", PROMPT_CHECKS_DIR)
  identity = getattr(tokenizer, "fingerprint", None)
  if not directory or identity is None:
    return None
  key = hashlib.blake2b(f"{digest}/{identity}".encode(), digest_size=16).hexdigest()
  return os.path.join(os.path.expanduser(directory), f"{key}.json")


def _read_longest(file: str | None) -> int | None:
  """The longest prompt kept in `file`; None where none is kept, or it is unreadable."""
  if file is None:
    return None
  try:
    with open(file) as f:
      longest = json.load(f)["longest"]
  except (OSError, TypeError, ValueError, KeyError):
    return None
  return longest if isinstance(longest, int) else None


def _write_longest(file: str, longest: int) -> None:
  """Kept atomically (trainers of one run may check at once); where it cannot be written,
  the next check is made again."""
  try:
    os.makedirs(os.path.dirname(file), exist_ok=True)
    temporary = f"{file}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
      json.dump({"longest": longest}, f)
    os.replace(temporary, file)
  except OSError:  # a read-only or full cache: the next check tokenizes again, no harm
    return


def prompt_limit(config, max_positions: int) -> tuple[int, str]:
  """(the longest prompt a worker can sample, the settings that bound it): rl.max_prompt_tokens,
  or the model's max_position_embeddings less worker.max_new_tokens where that is less (every
  worker would refuse a longer prompt). ValueError naming worker.max_new_tokens when it leaves
  no room for a prompt."""
  asked, new = int(config.rl.max_prompt_tokens), int(config.worker.max_new_tokens)
  room = int(max_positions) - new
  if room < 1:
    raise ValueError(f"worker.max_new_tokens: {new} leaves no room for a prompt in the "
                     f"model's max_position_embeddings={max_positions}")
  if room < asked:
    return room, (f"the model's max_position_embeddings={max_positions} - "
                  f"worker.max_new_tokens={new}")
  return asked, "rl.max_prompt_tokens"


def resume_lines(config, workdir: str) -> list[str]:
  """What an RL trainer on `config` says before step 1 when it resumes the latest checkpoint
  of `workdir`: ValueError where it refuses this config's data source or its updates per
  batch, else the lines it logs (data.allow_new_source taking other data, the lr schedule
  kept or changed); [] when there is none to resume. Reads that checkpoint's metadata alone, writing nothing."""
  from rlax_ps.train.prompts import iter_config_records
  from rlax_ps.train.run import data_source, resumed_optimizer, resumed_source_line
  directory, saved = resumed_metadata(config, workdir)
  if saved is None:
    return []
  check_resumed_updates(saved, int(config.rl.get("updates_per_batch", 1)))
  was = ((saved.get("config") or {}).get("publish") or {}).get("format")
  if was and was != config.publish.format:  # (its server's stored weights are of that format)
    raise ValueError(f"publish.format: {config.publish.format!r} now, {was!r} in the run's "
                     f"checkpoint in {directory} and the versions its parameter server holds; "
                     f"resume with publish.format={was!r}, or use another workdir")
  records, path = None, config.data.get("jsonl", "")
  if path and saved.get("data_source"):
    records = ((r["prompt"], r["answer"], r["task"])  # digested as read, none held
               for r in iter_config_records(config, "data.jsonl", path))
  lines = [resumed_source_line(saved, data_source(config, records), directory,
                               bool(config.data.get("allow_new_source", False)),
                               NEW_SOURCE_FED),
           resumed_optimizer(config.optimizer, int(config.rl.steps), saved, "rl.steps")[1]]
  return [line for line in lines if line]


def check_resumed_model(config, workdir: str, init_from_hf: str) -> str:
  """ValueError, in the trainer's words, where the latest checkpoint of `workdir` was written
  for another model than the trainer would build from `config` and `init_from_hf` (a warm
  start trained anew on another model block): said before the server and workers start, not
  by a worker refusing the first weights it is sent. Else the trainer's resumed_init_line
  (another init_from_hf than the run's, of the same shape), or ""."""
  from rlax_ps.models import longest_sequence, model_config_from
  from rlax_ps.train.run import resumed_init_line, run_tokenizer
  from rlax_ps.train.state import check_same_model
  directory, saved = resumed_metadata(config, workdir)
  if not saved:
    return ""
  if saved.get("model_config"):
    model_config = model_config_from(config.model, run_tokenizer(config).vocab_size,
                                     init_from_hf, longest_sequence(config))
    check_same_model(saved["model_config"], model_config, directory)
  return resumed_init_line(saved, init_from_hf)


def resumed_metadata(config, workdir: str) -> tuple[str, dict[str, Any] | None]:
  """(the RL checkpoint directory of `config` in `workdir`, as the trainer's Checkpointer
  names it; the metadata of its newest complete checkpoint, or None: none, or a bucket's,
  which the trainer checks itself)."""
  from rlax_ps.train.run import checkpoint_directory
  directory = checkpoint_directory(config, workdir)
  if "://" in directory:
    return directory, None
  directory = os.path.abspath(directory)
  return directory, latest_metadata(directory)


def latest_metadata(directory: str) -> dict[str, Any] | None:
  """The JSON metadata of the newest complete checkpoint in a local checkpoint directory
  (rlax_ps.checkpoint's layout: <step>/metadata/metadata; a step still being written has
  another name), read without orbax: no arrays, no JAX backend, nothing cleaned up under a
  trainer that may be saving there. None when there is none or it is unreadable (the
  trainer names a damaged one); ValueError where a newer rlax-ps wrote it
  (readable_metadata)."""
  from rlax_ps.checkpoint import METADATA, readable_metadata
  try:
    steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
  except OSError:  # none yet
    return None
  if not steps:
    return None
  try:
    with open(os.path.join(directory, str(max(steps)), METADATA, METADATA)) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(saved, dict):
    return None
  return readable_metadata(saved, directory)  # as the Checkpointer reads it


def check_resumed_updates(saved: dict[str, Any] | None, updates: int) -> None:
  """ValueError naming rl.updates_per_batch when it differs from the checkpoint's (metadata
  `saved`): the optimizer counts updates, and its lr schedule reads steps as the count over
  the updates a step takes, so another number moves the lr to another step's."""
  rl = ((saved or {}).get("config") or {}).get("rl") or {}
  was = int(rl.get("updates_per_batch", 1))
  if saved and was != updates:
    raise ValueError(
        f"rl.updates_per_batch: {was} in the checkpoint at step {saved.get('step')}, "
        f"{updates} now: the optimizer's update count would put the learning rate at step "
        f"{int(saved.get('step') or 0) * was // updates}'s; resume with {was}")
