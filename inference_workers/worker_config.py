"""WorkerConfig: the settings of one inference worker (no JAX import, so the CLI stays light)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

from algorithms.environments import environment_names
from rlax_ps.dataclass_flags import setting


# What a decode cache may hold keys and values in: float8 and int8 halve a bf16 cache, with a
# scale per token and head (kv_quant; values read back in the compute dtype).
KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "int8")
# The reward parts besides worker.reward_terms, by their names in a sample's metadata
# ("reward/<name>"): the prompt task's verifier and the reward model.
RESERVED_PARTS = ("task", "reward_model")
# Stopping: the worker's watchdog releases what is open this long before the grace period ends.
WATCHDOG_LEAD_S = 1.0


@dataclasses.dataclass
class WorkerConfig:
  """Everything `rlax-ps worker` can set besides the model; each is also a flag."""
  name: str = setting("worker", "name reported to the server (the server assigns the id)")
  weights_format: str = setting("bf16", "held weights: bf16 or int8 (must match the publications)")
  devices: int = setting(1, "accelerators of each host this worker decodes on (0: all of "
                         "them): the model split over tensor_parallel of them, the decode "
                         "slots over the rest")
  tensor_parallel: int = setting(1, "devices each copy of the model is split over (heads and "
                                 "widths); must divide the devices of all hosts")
  prompts_per_lease: int = setting(8, "prompts asked for per lease")
  lease_deadline_s: float = setting(300.0, "lease length; renewed while work is in flight")
  lease_wait_s: float = setting(2.0, "how long one lease request waits for prompts")
  prompts_per_call: int = setting(8, "prompts decoded together: the continuous batch's slots "
                                  "(VIGOR: the prompts of one call)")
  rows_per_prompt: int = setting(0, "decode rows per prompt (0: samples_per_prompt); fewer: "
                                 "a row takes the prompt's next sample when its own ends")
  sample_rows: int = setting(0, "> 0: this many decode rows shared by every leased prompt's "
                             "samples, each row drawing one sample and taking the next queued "
                             "one (of any prompt) when it ends, so no row waits for its "
                             "group's longest answer; each row holds its own copy of its "
                             "prompt's keys and values. "
                             "prompts_per_call and rows_per_prompt then do not apply")
  kv_cache_dtype: str = setting("", "dtype of the decode cache's keys and values: '' = the "
                                "model's compute dtype; float8_e4m3fn or int8 halve a bf16 "
                                "cache (twice the rows in the same memory, half the bytes a "
                                "TPU decode step reads), each with a scale per token and "
                                "head (no key overflows fp8's 448); the behaviour log-probs "
                                "are the ones sampled with")
  decode_chunk_steps: int = setting(32, "most decode steps between two looks at new weights, "
                                    "leases and stop requests")
  in_flight_updates: bool = setting(False, "apply new weights between decode chunks at once, "
                                    "not when the prompts started on the held version end")
  samples_per_prompt: int = setting(8, "N for the fixed allocator; VIGOR's per-prompt mean budget")
  greedy_baseline: bool = setting(False, "also decode one greedy sample of each prompt, "
                                  "scored as the others but sent beside them, not among "
                                  "them: its reward is the group's baseline "
                                  "(ReMax, loss.advantage='remax')")
  allocator: str = setting("fixed", "rollout allocation: fixed (GRPO) or vigor")
  allocator_args: str = setting("", "vigor: its settings as a JSON object, e.g. '{\"m0\": 4, "
                                "\"rounds\": 3, \"alpha\": 0.5, \"gamma\": 2}' (unset: "
                                "algorithms.allocation.VigorAllocator's)")
  max_new_tokens: int = setting(64, "generation budget per sample")
  temperature: float = setting(1.0, "sampling temperature (0 = greedy)")
  top_k: int = setting(0, "top-k truncation (0 = off)")
  top_p: float = setting(1.0, "top-p truncation (1 = off)")
  min_p: float = setting(0.0, "min-p truncation: keep the tokens at least min_p x as likely as "
                         "the most likely one, after temperature, before top-k/top-p, as "
                         "vLLM's (0 = off)")
  default_task: str = setting("addition", "verifier for prompts that name no task")
  verifiers: str = setting("", "Python files or modules (comma-separated) to import first: "
                           "the verifiers they @register_verifier can be a prompt's task, "
                           "the environments they @register_environment answer turns")
  environment: str = setting("", "multi-turn: the environment that answers each turn a sample "
                             "ends (e.g. calculator), or environments by task "
                             "('math=python,chat=calculator'; '*=NAME': the other tasks; a "
                             "task without one is single-turn); '' = one turn")
  environment_args: str = setting("", "multi-turn: the environment's arguments as a JSON object, "
                                  "e.g. '{\"timeout_s\": 30}' for python; with several, an "
                                  "object of them by environment name")
  environment_timeout_s: float = setting(300.0, "multi-turn: an environment call that takes "
                                         "longer gets a TimeoutError as its reply (the call "
                                         "is left on its thread); 0 = no limit")
  max_turns: int = setting(4, "multi-turn: most environment replies per sample")
  environment_threads: int = setting(8, "multi-turn: environment calls run at once (on threads, "
                                     "while decoding goes on); 1 for one that is not "
                                     "thread-safe")
  scoring_threads: int = setting(8, "finished samples are scored by their verifier (and "
                                 "reward terms) this many at once, on threads, of one group "
                                 "or several: a code task's tests run side by side; 1 for a "
                                 "verifier that is not thread-safe")
  reward_model: str = setting("", "a reward model checkpoint (an HF *ForSequenceClassification "
                              "folder): it scores prompts of task reward_model, and adds "
                              "reward_model_weight x its score to every other task's reward")
  reward_model_weight: float = setting(0.0, "weight of the reward model's score added to a "
                                       "verifier's reward (0: only reward_model tasks use it)")
  reward_terms: str = setting("", "rewards added to every sample's, as TRL's reward_funcs and "
                              "reward_weights: comma-separated NAME:WEIGHT (NAME alone: "
                              "weight 1; the weight follows the last colon, may be negative, "
                              "0 logs the term only), each NAME a prompt task's verifier "
                              "(think_format, math, task:addition, one worker.verifiers "
                              "registers); each sample's raw parts go to the trainer's log")
  reward_model_dtype: str = setting("bfloat16", "the reward model's params and activations")
  teacher: str = setting("", "on-policy distillation with the teacher on the workers: an HF "
                         "checkpoint of the policy's tokenizer that scores each finished "
                         "group's tokens on this worker's devices, sent with the group "
                         "(loss.advantage='opd', loss.distill_topk; instead of teacher.path "
                         "on the trainer)")
  teacher_tokenizer: str = setting("", "with teacher: the path of its own tokenizer (its "
                                   "checkpoint folder) where it is not the policy's: each "
                                   "response's text is tokenized for it and its log-probs "
                                   "shared out over the policy's tokens of the same text; "
                                   "'': the policy's")
  teacher_topk: int = setting(0, "with teacher: also its this many most likely tokens at each "
                              "sampled position (loss.distill_topk)")
  teacher_dtype: str = setting("bfloat16", "the teacher's params and activations")
  teacher_logits_chunk: int = setting(1024, "with teacher: response positions projected to "
                                      "its vocabulary at a time (0: a group's all at once, "
                                      "samples x max_new_tokens x vocab floats)")
  reward_model_batch: int = setting(16, "sequences the reward model scores per call")
  grace_s: float = setting(25.0, "after SIGTERM: time to submit or release everything in flight")
  stall_s: float = setting(1800.0, "a decode chunk running longer than this (a hung device; "
                           "the first one's compile included) releases the worker's prompts "
                           "to the others and exits 1, for its supervisor to restart it; "
                           "0: never")
  salvage_s: float = setting(5.0, "after SIGTERM, with this much grace left, samples still "
                             "decoding go back with their prompts (partial rollouts) and the "
                             "next worker continues them; 0: they start over")
  checkpoint_s: float = setting(60.0, "with salvage_s: every this many seconds the tokens "
                                "decoded since the last checkpoint go to the server with the "
                                "lease renewals, so that a worker killed without notice loses "
                                "at most about this much decoding; 0: only on SIGTERM")
  backoff_initial_s: float = setting(0.5, "first wait after the server could not be reached")
  backoff_max_s: float = setting(30.0, "longest wait between reconnection attempts")
  max_leases: int = setting(0, "exit after this many non-empty leases (0 = run until stopped)")
  seed: int = setting(0, "mixed into the seeds of a prompt's samples where its trainer gave "
                      "it none (an RL trainer gives each prompt one: any worker samples it "
                      "alike)")
  routing_replay: bool = setting(False, "mixture of experts: send each token's experts with the "
                                 "rollouts, for the trainer to route by (routing replay)")

  def allocator_settings(self) -> dict:
    """allocator_args as keyword arguments of the allocator (ValueError naming the field)."""
    if not self.allocator_args:
      return {}
    try:
      args = json.loads(self.allocator_args)
    except json.JSONDecodeError as e:
      raise ValueError(f"WorkerConfig.allocator_args: expected a JSON object, got "
                       f"{self.allocator_args!r} ({e})") from None
    if not isinstance(args, dict):
      raise ValueError(f"WorkerConfig.allocator_args: expected a JSON object, got "
                       f"{self.allocator_args!r}")
    from algorithms.allocation import VigorAllocator
    try:
      VigorAllocator(**args)
    except TypeError as e:  # an unknown setting
      raise ValueError(f"WorkerConfig.allocator_args: {e}; expected m0, rounds, alpha, "
                       "gamma") from None
    except ValueError as e:
      raise ValueError(f"WorkerConfig.allocator_args: {e}") from None
    return args

  def reward_term_weights(self) -> list[tuple[str, float]]:
    """reward_terms as (verifier name, weight) pairs (ValueError naming the field)."""
    terms: list[tuple[str, float]] = []
    for entry in self.reward_terms.split(",") if self.reward_terms.strip() else []:
      name, colon, weight = entry.strip().rpartition(":")
      if not colon or name == "task":  # NAME alone (task:<name> included): weight 1
        name, weight = entry.strip(), "1"
      try:
        value = float(weight)
      except ValueError:
        value = math.nan
      name = name.strip()
      if not name or not math.isfinite(value):
        raise ValueError(f"WorkerConfig.reward_terms: expected comma-separated NAME:WEIGHT "
                         f"(WEIGHT a finite float) or NAME, got {entry.strip()!r} in "
                         f"{self.reward_terms!r}")
      if name in RESERVED_PARTS or any(name == n for n, _ in terms):
        raise ValueError(f"WorkerConfig.reward_terms: expected each verifier once and none "
                         f"of {RESERVED_PARTS} (the names of the other reward parts), got "
                         f"{name!r} in {self.reward_terms!r}")
      terms.append((name, value))
    return terms

  def __post_init__(self):
    def need(cond, field, expected):
      if not cond:
        raise ValueError(f"WorkerConfig.{field}: expected {expected}, got {getattr(self, field)!r}")
    need(self.weights_format in ("bf16", "int8"), "weights_format", "'bf16' or 'int8'")
    need(self.allocator in ("fixed", "vigor"), "allocator", "'fixed' or 'vigor'")
    need(not self.allocator_args or self.allocator == "vigor", "allocator_args",
         "'' with allocator='fixed' (its N is samples_per_prompt)")
    settings = self.allocator_settings()  # checked now, named, not when the first lease comes
    if self.allocator == "vigor":
      from algorithms.allocation import VigorAllocator
      m0 = VigorAllocator(**settings).m0
      need(self.samples_per_prompt >= m0, "samples_per_prompt",
           f">= allocator_args' m0={m0} (VIGOR's budget is samples_per_prompt a prompt, its "
           f"first round m0 each)")
    self.reward_term_weights()
    for f in ("prompts_per_lease", "prompts_per_call", "samples_per_prompt", "max_new_tokens",
              "decode_chunk_steps"):
      need(getattr(self, f) > 0, f, "a positive int")
    need(self.devices >= 0, "devices", "an int >= 0 (0: all local devices)")
    need(self.tensor_parallel > 0 and (self.devices == 0 or self.devices % self.tensor_parallel
                                       == 0), "tensor_parallel",
         f"a positive divisor of devices={self.devices}")
    need(self.reward_model_batch > 0, "reward_model_batch", "a positive int")
    need(self.reward_model_dtype in ("float32", "bfloat16"), "reward_model_dtype",
         "'float32' or 'bfloat16'")
    need(self.teacher_dtype in ("float32", "bfloat16"), "teacher_dtype",
         "'float32' or 'bfloat16'")
    need(self.teacher_topk >= 0 and (self.teacher or not self.teacher_topk), "teacher_topk",
         "0 without a teacher, else an int >= 0")
    need(self.teacher or not self.teacher_tokenizer, "teacher_tokenizer",
         "'' without a teacher")
    need(not (self.teacher_tokenizer and self.teacher_topk), "teacher_topk",
         "0 with teacher_tokenizer (the teacher's top tokens are ids of its own vocabulary)")
    need(self.teacher_logits_chunk >= 0, "teacher_logits_chunk", "an int >= 0 (0: no chunks)")
    need(self.reward_model or self.default_task != "reward_model", "reward_model",
         "a reward model checkpoint when default_task='reward_model'")
    need(self.reward_model or not self.reward_model_weight, "reward_model",
         f"a reward model checkpoint when reward_model_weight={self.reward_model_weight}")
    need(self.kv_cache_dtype in ("",) + KV_DTYPES, "kv_cache_dtype",
         f"'' (the model's) or one of {KV_DTYPES}")
    need(0 <= self.min_p <= 1, "min_p", "a number in [0, 1] (0: off)")
    need(self.max_turns >= 0, "max_turns", "an int >= 0")
    need(self.environment_threads > 0, "environment_threads", "a positive int")
    need(self.scoring_threads > 0, "scoring_threads", "a positive int")
    need(self.environment_timeout_s >= 0, "environment_timeout_s", "seconds >= 0 (0: no limit)")
    try:
      environment_names(self.environment)
    except ValueError as e:
      raise ValueError(f"WorkerConfig.{str(e).removeprefix('worker.')}") from None
    need(0 <= self.rows_per_prompt <= self.samples_per_prompt, "rows_per_prompt",
         f"an int in [0, samples_per_prompt={self.samples_per_prompt}]")
    # VIGOR's rounds decode whole calls, between which weights change: neither applies.
    need(not self.rows_per_prompt or self.allocator == "fixed", "rows_per_prompt",
         f"0 with allocator={self.allocator!r} (its rounds decode every sample of a call)")
    need(not self.in_flight_updates or self.allocator == "fixed", "in_flight_updates",
         f"False with allocator={self.allocator!r} (its rounds take new weights between "
         f"calls only)")
    need(not self.greedy_baseline or self.allocator == "fixed", "greedy_baseline",
         f"False with allocator={self.allocator!r} (its rounds draw unequal groups)")
    need(self.sample_rows >= 0, "sample_rows", "an int >= 0 (0: prompts_per_call slots)")
    need(not self.sample_rows or self.allocator == "fixed", "sample_rows",
         f"0 with allocator={self.allocator!r} (its rounds decode prompts_per_call prompts)")
    need(self.salvage_s == 0 or 2 * WATCHDOG_LEAD_S <= self.salvage_s < self.grace_s,
         "salvage_s", f"0 (off) or a number of seconds in [{2 * WATCHDOG_LEAD_S:g}, "
         f"grace_s={self.grace_s}) (the watchdog releases every open prompt, without its "
         f"samples, {WATCHDOG_LEAD_S:g}s before the end)")
    need(self.checkpoint_s >= 0, "checkpoint_s", "a number of seconds >= 0")
    need(self.stall_s >= 0, "stall_s", "a number of seconds >= 0 (0: never)")
    for f in ("lease_deadline_s", "grace_s", "backoff_initial_s", "backoff_max_s"):
      need(getattr(self, f) > 0, f, "a positive number of seconds")
    need(self.lease_wait_s >= 0, "lease_wait_s", "a number of seconds >= 0")
    need(self.max_leases >= 0, "max_leases", "an int >= 0 (0: run until stopped)")

  @property
  def draws(self) -> int:
    """Samples decoded per prompt (fixed allocator): samples_per_prompt, plus the greedy one
    with greedy_baseline."""
    return self.samples_per_prompt + int(self.greedy_baseline)

  def sampling(self, stop_tokens: Sequence[int]):
    """The SamplingParams these settings describe."""
    from inference_workers.sampling import SamplingParams  # imports JAX
    return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                          min_p=self.min_p,
                          max_new_tokens=self.max_new_tokens, stop_tokens=tuple(stop_tokens))
