"""The held-out set a config names, as the trainers and `rlax-ps eval` score it: the
built-in tasks' held-out split, or a JSONL file's records scored by their verifiers."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from absl import logging

from algorithms.environments import environments_from
from algorithms.verifiers import REWARD_MODEL_TASK, load_verifiers
from rlax_ps.tasks import Example, Task
from rlax_ps.tokenizers import Tokenizer
from rlax_ps.train import evaluate as evaluate_lib
from rlax_ps.train.prompts import config_records


@dataclasses.dataclass
class Heldout:
  """What exact_match and pass_at_k take: the tasks that score each name, the examples per
  name, the decoding budget (None: each set's longest answer and eos), the workers'
  environments by task and max_turns (multi-turn; none: one turn), and the workers'
  sampling settings that pass@k draws with (`worker_sampling`)."""
  tasks: list[Any]
  examples: dict[str, list[Example]]
  max_new_tokens: int | None
  environments: dict = dataclasses.field(default_factory=dict)
  max_turns: int = 0
  sampling: dict[str, float] = dataclasses.field(default_factory=lambda: worker_sampling({}))

  @property
  def size(self) -> int:
    return sum(len(v) for v in self.examples.values())


def heldout_from_config(config, tasks: Sequence[Task], tokenizer: Tokenizer | None = None
                        ) -> Heldout:
  """data.heldout_jsonl's records (all of them, each scored by its task's verifier, or those
  of task reward_model by worker.reward_model, loaded here beside the policy `tokenizer`;
  decoding up to eval.max_new_tokens or worker.max_new_tokens, or past the longest answer)
  if the config names one, else eval.num_examples held-out examples of each task (eval.seed;
  up to eval.max_new_tokens, else worker.max_new_tokens under a chat template, else past
  the longest answer).
  ValueError for eval.pass_k at a greedy worker.temperature, before anything is scored."""
  worker = config.get("worker", {})
  decoding = dict(_turns(worker), sampling=worker_sampling(worker))
  pass_k = int(config.eval.get("pass_k", 0))
  if pass_k and decoding["sampling"]["temperature"] <= 0:
    raise ValueError(f"eval.pass_k: {pass_k} samples a prompt at worker.temperature, which is "
                     f"0 (greedy: every sample alike); set eval.pass_k=0 or a temperature > 0")
  data = config.get("data", {})
  path = data.get("heldout_jsonl", "")
  if not path:
    if not tasks and int(config.eval.num_examples):
      logging.warning("data.heldout_jsonl is not set and the config names no built-in task: "
                      "nothing is evaluated held out; set data.heldout_jsonl to records of "
                      "your own")
    elif data.get("jsonl", "") and int(config.eval.num_examples):
      logging.warning("data.heldout_jsonl is not set: the held-out evaluation scores the "
                      "built-in tasks (tasks.*), not data.jsonl's; set data.heldout_jsonl to "
                      "records of your own, or eval.num_examples=0 to evaluate nothing")
    # eval.max_new_tokens, else the workers' where a chat template frames the answer (an
    # instruct model says more than it), else each task's longest answer and eos
    budget = int(config.eval.get("max_new_tokens", 0)) or (
        config.get("tokenizer", {}).get("chat_template") and worker.get("max_new_tokens"))
    return Heldout(list(tasks), {t.name: t.examples("heldout", int(config.eval.seed),
                                                    int(config.eval.num_examples))
                                 for t in tasks}, int(budget) if budget else None, **decoding)
  records = config_records(config, "data.heldout_jsonl", path)
  names = sorted({r["task"] for r in records})
  examples = {n: [Example(r["prompt"], r["answer"], n) for r in records if r["task"] == n]
              for n in names}
  # eval.max_new_tokens, else the workers' budget, else (neither: an SFT config) each set's
  # longest answer and eos: a reference answer may be far shorter than a reasoned one
  budget = int(config.eval.get("max_new_tokens", 0)) or worker.get("max_new_tokens")
  scored = [evaluate_lib.VerifierTask(n) if n != REWARD_MODEL_TASK
            else evaluate_lib.RewardModelTask(_reward_scorer(worker, tokenizer), tokenizer)
            for n in names]
  return Heldout(scored, examples,
                 None if budget is None else int(budget), **decoding)


def _reward_scorer(worker, tokenizer: Tokenizer | None):
  """worker.reward_model, loaded as the workers load it."""
  from rlax_ps.reward_scoring import RewardScorer
  if tokenizer is None:
    raise ValueError(f"data.heldout_jsonl: records of task {REWARD_MODEL_TASK!r} are scored by "
                     f"worker.reward_model, which this command does not load")
  return RewardScorer(str(worker.reward_model), tokenizer,
                      str(worker.get("reward_model_dtype", "bfloat16")),
                      int(worker.get("reward_model_batch", 16)))


def _turns(worker) -> dict[str, Any]:
  """The environments worker.environment names by task (after importing worker.verifiers),
  and worker.max_turns: held-out answers are decoded in as many turns as the workers'."""
  spec = str(worker.get("environment", ""))
  if not spec:
    return {}
  load_verifiers(str(worker.get("verifiers", "")), "worker.verifiers")
  timeout_s = float(worker.get("environment_timeout_s", 0)) or None
  return dict(environments=environments_from(spec, worker.get("environment_args", ""), timeout_s),
              max_turns=int(worker.get("max_turns", 4)))


def exact_match(graphdef, params, tokenizer: Tokenizer, heldout: Heldout, config
                ) -> dict[str, float]:
  """Greedy exact match per name and over all, in batches of eval.batch_size."""
  return evaluate_lib.exact_match(graphdef, params, tokenizer, heldout.tasks, heldout.examples,
                                  batch_size=int(config.eval.batch_size),
                                  max_new_tokens=heldout.max_new_tokens,
                                  environments=heldout.environments,
                                  max_turns=heldout.max_turns)


def pass_at_k(graphdef, params, tokenizer: Tokenizer, heldout: Heldout, config
              ) -> dict[str, float] | None:
  """pass@1 and pass@eval.pass_k sampled as the workers sample (heldout.sampling, eval.seed);
  None when eval.pass_k is 0."""
  k = int(config.eval.get("pass_k", 0))
  if not k:
    return None
  return evaluate_lib.pass_at_k(graphdef, params, tokenizer, heldout.tasks, heldout.examples,
                                k=k, max_new_tokens=heldout.max_new_tokens,
                                **heldout.sampling, seed=int(config.eval.seed),
                                batch_size=int(config.eval.batch_size),
                                environments=heldout.environments,
                                max_turns=heldout.max_turns)


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def worker_sampling(worker) -> dict[str, float]:
  """The temperature, top_k, top_p and min_p a worker of this `worker` block samples with:
  WorkerConfig.sampling of its settings (WorkerConfig's defaults where it has none).
  ValueError naming the worker.<field> a worker would refuse."""
  from inference_workers.worker_config import WorkerConfig
  given = {name: worker[name] for name in SAMPLING_FIELDS if name in worker}
  try:
    params = dataclasses.replace(WorkerConfig(), **given).sampling(())
  except (TypeError, ValueError) as e:
    raise ValueError(re.sub(r"^(WorkerConfig|SamplingParams)\.", "worker.", str(e))) from None
  return {name: getattr(params, name) for name in SAMPLING_FIELDS}
