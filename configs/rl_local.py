r"""rlax-ps local --config=configs/rl_local.py --workdir=runs/rl_local

The embedded default (`make run`): GRPO with PPO clip-higher, bf16 publications, staleness
bound 1, on the built-in addition and reversal tasks. `rlax-ps local` first runs the
supervised warm start (the unchanged `configs/sft_tiny.py` default) in <workdir>/sft unless
`init_from_hf` names a checkpoint, then starts a parameter server, the trainer and
`local.workers` workers on 127.0.0.1 and trains for `rl.steps` steps or `rl.max_seconds`.

The other recipes change a few fields of this one:
  configs/rl_vigor.py       VIGOR rollout allocation (unequal groups)
  configs/rl_int8_tis.py    int8 publications, truncated importance sampling
  configs/rl_sync.py        fully synchronous (max_staleness 0)
  configs/rl_decoupled.py   decoupled PPO with the workers' behaviour log-probs
  configs/rl_dapo.py        DAPO dynamic sampling (groups with all-equal rewards left out)
  configs/rl_ppo.py         PPO with a critic (GAE), as verl runs it by default
  configs/rl_reinforce_pp.py  REINFORCE++ with baseline, the KL in the reward
  configs/rl_remax.py       ReMax: the greedy answer's reward as the baseline
  configs/rl_gpg.py         GPG: the plain policy gradient, no ratio
  configs/rl_distill.py     on-policy distillation from a teacher checkpoint
  configs/rl_instruct.py    your instruct checkpoint on your math data, via its chat template
  configs/rl_tools.py       the same, multi-turn: a calculator tool answers each turn
  configs/rl_lora.py        the same, LoRA: adapters trained and synced alone
  configs/rl_moe.py         the same for a mixture of experts (routing replay, int8 experts)
  configs/rl_reward_model.py  the same, prompts scored by a reward model (RLHF)

Variants:
  configs/rl_local.py        the `make run` default (2 CPU cores, about 10 minutes of RL).
  configs/rl_local.py:tiny   about a minute: a smoke test of the whole loop (used by the tests).

Override any field, e.g. --config.rl.steps=50 --config.local.workers=1.
"""

import ml_collections

from inference_workers.worker_config import WorkerConfig
from rlax_ps.config_files import sibling, with_defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "tiny"):
    raise ValueError(f"configs/rl_local.py: unknown variant {arg!r}; expected '' or 'tiny'")
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds the prompt stream, each prompt's samples (on any worker), a fresh init.
  # The policy to start from: an HF checkpoint folder. "" = `rlax-ps local` runs the `sft`
  # block in <workdir>/sft (reused once finished) and starts from its export.
  c.init_from_hf = ""
  c.sft = sibling(__file__, "sft_tiny.py", arg or None)  # the unchanged sft default
  # Model, tokenizer and tasks are the warm start's (the same objects: one override
  # changes both).
  c.model = c.sft.model
  c.tokenizer = c.sft.tokenizer
  c.tasks = c.sft.tasks

  # Prompts: JSONL or Parquet files (paths or URLs such as gs://bucket/train.jsonl, several
  # joined by commas) of {"prompt", "answer"[, "task"]} records, or "" for the tasks above.
  # A record's task (else worker.default_task) names a built-in task or a verifier, which
  # worker.verifiers can add from your own files.
  c.data = ml_collections.ConfigDict()
  c.data.jsonl = ""
  # Several files mixed: one weight a file, comma-joined ("3,1": three prompts of the first
  # for one of the second), each file shuffled and repeated on its own; "" = their records
  # as one set (each file's share is its size).
  c.data.weights = ""
  # Held-out records in the same form, evaluated instead of the tasks' held-out split (all
  # of them, each scored by its task's verifier, decoding up to worker.max_new_tokens).
  c.data.heldout_jsonl = ""
  # Where a record keeps each field (dotted for nested ones); a verl file's answer is
  # "reward_model.ground_truth"; answer_key "" reads prompts alone (task reward_model:
  # worker.reward_model scores them).
  c.data.prompt_key = "prompt"
  c.data.answer_key = "answer"
  c.data.task_key = "task"
  # A rerun on data other than its checkpoint's is refused; True trains on the new data
  # instead (RL: from its first record).
  c.data.allow_new_source = False

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 5000  # Optimizer steps in all (on 2 CPU cores max_seconds ends the run first).
  c.rl.max_seconds = 600.0  # Stop (checkpoint, evaluate) after this much wall time; 0 = none.
  c.rl.groups_per_step = 16  # Rollout groups (prompts) per optimizer step.
  c.rl.max_staleness = 1  # Policy versions a group may lag the newest; 0 = synchronous.
  c.rl.publish_every = 1  # Steps between published versions.
  c.rl.updates_per_batch = 1  # Optimizer updates per batch (PPO epochs; > 1: the clip binds).
  # Slices of the batch whose gradients are accumulated (same update, a slice's activation
  # memory); divides groups_per_step.
  c.rl.micro_batches = 1
  c.rl.max_prompt_tokens = 24  # Packed prompt capacity, bos included.
  # A step's rows are packed to the smallest of this many response capacities (the budget
  # worker.max_new_tokens, half of it, a quarter, ...) that holds its longest response: short
  # responses cost short rows; the step is compiled ahead for each. 1: always the budget.
  c.rl.response_buckets = 4
  c.rl.ack_deadline_s = 1800.0  # Taken groups come back if unacknowledged this long.
  c.rl.take_timeout_s = 600.0  # Give up when no rollout arrives, or the server does not
  # answer, for this long.
  # DAPO dynamic sampling: leave out groups whose rewards are all equal (zero advantage) and
  # take more, at most dynamic_sampling_max_factor * groups_per_step a step; past that the
  # step is filled with the first ones left out.
  c.rl.dynamic_sampling = False
  c.rl.dynamic_sampling_max_factor = 3.0
  # Selective rollouts over data.jsonl's epochs (algorithms.selection): a record whose last
  # z groups came back all correct (every reward >= 1) is fed again with probability
  # revisit_solved ** z, one whose last z groups were all equal below 1 with revisit_failed
  # ** z; 1.0: always (off), 0.0: never again. Such groups have no advantage to learn from.
  c.rl.revisit_solved = 1.0
  c.rl.revisit_failed = 1.0
  # TRL's reference-model sync (TR-DPO; its sync_ref_model, ref_model_sync_steps,
  # ref_model_mixup_alpha): every ref_sync_steps steps the KL reference (loss.kl_coef > 0)
  # becomes ref_mixup_alpha * policy + (1 - ref_mixup_alpha) * reference; 0 = never (frozen).
  c.rl.ref_sync_steps = 0
  c.rl.ref_mixup_alpha = 0.6

  # The objective (rlax_ps.train.rl_loss.LossConfig).
  c.loss = ml_collections.ConfigDict()
  # grpo | dr_grpo | rloo | mc_grpo | opo | passk (pass@k training) | gpg (GPG: r - group
  # mean, scaled by B / (B - M) for the M samples of all-equal groups; with policy_loss pg) |
  # reinforce_pp | reinforce_pp_baseline (verl's REINFORCE++: per-token, whitened over the
  # batch's tokens) | gae (PPO with a critic: the `critic` block; configs/rl_ppo.py) | opd
  # (on-policy distillation: each sampled token's log pi_teacher - log pi_sampled, the
  # `teacher` block's model; configs/rl_distill.py)
  c.loss.advantage = "grpo"
  c.loss.gamma = 1.0  # reinforce_pp, gae: the returns' discount (verl's algorithm.gamma)
  c.loss.lam = 1.0  # gae: its lambda (verl's algorithm.lam)
  # grpo, mc_grpo, passk: divide by the std of each group (unset: "group") or of the whole
  # batch's rewards ("batch": TRL's scale_rewards="batch"); dr_grpo, rloo, opo divide by none;
  # gpg by none unless set.
  c.loss.scale_rewards = ml_collections.config_dict.placeholder(str)
  c.loss.std_eps = 1e-6  # grpo, mc_grpo: added to that std (verl's; TRL's is 1e-4).
  # sum: the workers' weighted sum of the reward parts | normalize_then_sum (GDPO, TRL's
  # multi_objective_aggregation): each of worker.reward_terms' parts normalised apart.
  c.loss.reward_aggregation = "sum"
  # ppo | gspo | cispo (REINFORCE weighted by the clipped ratio) | geo_mean (GMPO: each
  # sequence's geometric-mean ratio, its tokens clipped in log space) | kl_cov (unclipped, the
  # kl_cov_ratio of tokens whose log-prob and advantage covary most held near the old policy
  # by kl_cov_coef * |log-ratio|) | clip_cov (PPO-clip; at most clip_cov_ratio of the tokens,
  # drawn from those whose covariance lies in (clip_cov_lb, clip_cov_ub), lose their
  # gradient): KL-Cov and Clip-Cov work against entropy collapse | sapo (SAPO: no clip; each
  # token's step gated by sigmoid(tau (r - 1)) * 4 / tau, tau sapo_tau_pos where A > 0 else
  # sapo_tau_neg) | pg (the plain policy gradient -A log pi: GPG's loss).
  c.loss.policy_loss = "ppo"
  c.loss.kl_cov_ratio = 2e-4
  c.loss.kl_cov_coef = 1.0
  c.loss.clip_cov_ratio = 2e-4
  c.loss.clip_cov_lb = 1.0
  c.loss.clip_cov_ub = 5.0
  c.loss.sapo_tau_pos = 1.0
  c.loss.sapo_tau_neg = 1.05
  c.loss.correction = "none"  # none | tis | mis | decoupled | m2po
  # The policy loss's clip bounds and aggregation; unset: its own (ppo: 0.2 and 0.28, DAPO's
  # clip-higher, token-mean; gspo: 3e-4, 4e-4, seq-mean-token-mean; cispo: 1.0, 0.28;
  # geo_mean: 0.4, 0.4 of the log-ratio, seq-mean-token-mean; clip_cov: PPO's; kl_cov:
  # none, token-mean; sapo: none, seq-mean-token-mean; pg: none, token-mean).
  c.loss.clip_low = ml_collections.config_dict.placeholder(float)
  c.loss.clip_high = ml_collections.config_dict.placeholder(float)
  c.loss.agg = ml_collections.config_dict.placeholder(str)
  # ppo: a negative-advantage token's loss stops growing at -dual_clip * A (dual-clip PPO,
  # > 1: verl's clip_ratio_c, TRL's delta); unset: off.
  c.loss.dual_clip = ml_collections.config_dict.placeholder(float)
  c.loss.tis_cap = 2.0
  c.loss.is_level = "token"  # tis / mis ratio: token | sequence (the product) | geometric
  c.loss.behaviour_cap = 5.0
  c.loss.mis_low = 0.5  # masked IS: tokens with pi_trainer / pi_worker outside weigh 0
  c.loss.mis_high = 2.0
  c.loss.m2po_threshold = 0.04  # M2PO's bound on the second moment of log(pi_t / pi_w)
  # > 0: no policy loss for a negative-advantage sample whose mean log(pi_worker / pi_trainer)
  # exceeds this (DeepSeek-V3.2, TRL's off_policy_mask_threshold); unset: off.
  c.loss.off_policy_mask = ml_collections.config_dict.placeholder(float)
  c.loss.overlong_buffer = 0  # > 0: DAPO's soft overlong punishment over these last tokens
  # True: responses cut at worker.max_new_tokens get no loss (their rewards still join their
  # group's baseline): DAPO's advice, TRL's mask_truncated_completions.
  c.loss.mask_truncated = False
  # < 1: policy loss on this top share of the batch's tokens by entropy alone (0.2: "Beyond
  # the 80/20 rule", TRL's top_entropy_quantile); 1.0: every token.
  c.loss.top_entropy_quantile = 1.0
  c.loss.entropy_coef = 0.0  # > 0: an entropy bonus, minus coef * entropy (verl's entropy_coeff).
  # True: entropy_coef starts an adaptive coefficient (Skywork-OR1, TRL's use_adaptive_entropy).
  c.loss.adaptive_entropy = False
  c.loss.entropy_target = 0.2  # The bonus applies while the last step's entropy is at most this.
  c.loss.entropy_coef_delta = 0.005  # Each step: up by this if entropy <= target, else down.
  c.loss.entropy_coef_min = 0.0  # The adaptive coefficient's bounds.
  c.loss.entropy_coef_max = 1.0
  c.loss.kl_coef = 0.0  # > 0: KL to the warm start (frozen unless rl.ref_sync_steps).
  # > 0: plus distill_coef x the forward KL from the `teacher` block's model's k most likely
  # next tokens (renormalised) to the policy's, at every sampled position (GKD on the
  # policy's own samples; configs/rl_distill.py).
  c.loss.distill_topk = 0
  c.loss.distill_coef = 1.0
  # > 0: each token's reward minus this times its KL to the warm start (verl's
  # use_kl_in_reward with a fixed kl_ctrl.kl_coef), the score on the last token.
  c.loss.kl_in_reward = 0.0
  # Set: kl_in_reward adapts toward this KL (verl's kl_ctrl.type=adaptive, target_kl, horizon
  # in samples); unset: fixed.
  c.loss.kl_target = ml_collections.config_dict.placeholder(float)
  c.loss.kl_horizon = 10000
  c.loss.router_aux_coef = 0.0  # Mixture of experts: > 0 adds the load-balancing loss.
  # Schulman's estimators of KL(pi || reference): k1 (verl's kl_loss_type "kl") | k2 (verl's
  # "mse") | k3 | low_var_kl (verl's default and its "k3": k3 clamped to [-10, 10]) | abs (verl's).
  c.loss.kl_estimator = "k3"
  # True: each token's KL times its ratio pi / pi_old (TRL's use_bias_correction_kl).
  c.loss.kl_bias_correction = False
  c.loss.backend = "auto"  # Shared-prompt attention: Pallas on TPU/GPU, XLA on CPU.
  # > 0: response positions projected to the vocabulary at a time (bounds logits memory).
  c.loss.logits_chunk = 0
  c.loss.remat = False  # Recompute each layer in the backward pass (less activation memory).

  # Publications: bf16 or int8 deltas, a keyframe every keyframe_every versions.
  c.publish = ml_collections.ConfigDict()
  c.publish.format = "bf16"
  c.publish.keyframe_every = 50

  # Optimizer (rlax_ps.optim), constant after a short warmup.
  c.optimizer = ml_collections.ConfigDict(c.sft.optimizer.to_dict())
  c.optimizer.lr = 5e-5
  c.optimizer.warmup_steps = 5
  c.optimizer.min_lr_ratio = 1.0
  c.optimizer.weight_decay = 0.0

  # PPO's critic (loss.advantage="gae"): its own optimizer (the policy's settings as the
  # recipe wrote them), verl's clipped value loss range (critic.cliprange_value; None, or
  # inf from a flag: unclipped), the first steps it trains alone (verl's trainer.critic_warmup=N+1 skips as
  # many actor updates), and an HF checkpoint it starts from: "" the policy's weights (a
  # LoRA run's critic: adapters of its own over the policy's frozen weights), or a
  # *ForSequenceClassification reward model (its score head the value head) or causal LM of
  # the policy's tokenizer (a LoRA run's critic: adapters over its frozen weights).
  c.critic = ml_collections.ConfigDict()
  c.critic.optimizer = ml_collections.ConfigDict(c.optimizer.to_dict())
  c.critic.value_clip = 0.5
  c.critic.warmup_steps = 0
  c.critic.init_from_hf = ""

  # On-policy distillation's teacher (loss.advantage="opd"; configs/rl_distill.py): an HF
  # checkpoint folder of the policy's tokenizer, on the trainer's mesh, that scores every
  # sampled token once a step.
  c.teacher = ml_collections.ConfigDict()
  c.teacher.path = ""
  # A teacher of another tokenizer: the folder of its tokenizer.json (usually teacher.path).
  # It scores the text of each response after the prompt (its own chat template renders a
  # conversation); each span both tokenize alike gets its log-prob, shared out over the
  # policy's tokens. loss.distill_topk must be 0 (its top tokens are of its vocabulary).
  c.teacher.tokenizer = ""

  c.mesh = ml_collections.ConfigDict(c.sft.mesh.to_dict())

  c.checkpoint = ml_collections.ConfigDict()
  # "" = <workdir>/checkpoints. A multi-host trainer needs storage every host sees there,
  # e.g. gs://bucket/run/checkpoints.
  c.checkpoint.directory = ""
  c.checkpoint.every_steps = 10  # Groups are acknowledged once their step is checkpointed.
  c.checkpoint.max_to_keep = 2
  c.checkpoint.async_save = False

  # Weights & Biases (pip install 'rlax-ps[wandb]'): the run's scalars go to this project too
  # (TensorBoard in <workdir>/tb always); a resumed run goes on in the same W&B run.
  # WANDB_MODE=offline keeps it on disk for `wandb sync`.
  c.wandb = ml_collections.ConfigDict()
  c.wandb.project = ""  # "" = off
  c.wandb.entity = ""  # "" = your default entity
  c.wandb.group = ""

  # Sample completions, to read what the policy writes (reward hacking, format collapse,
  # truncation): every completions_every steps (0 = off) the step's first completions_groups
  # groups, all their samples (prompt, answer, completion, reward, advantage, tokens, finish
  # reason, worker), go to <workdir>/completions.jsonl and a table in TensorBoard's text tab
  # (W&B: a wandb.Table).
  c.log = ml_collections.ConfigDict()
  c.log.completions_every = 10
  c.log.completions_groups = 2

  # The trained policy in Hugging Face format (config.json, safetensors, tokenizer) in
  # <workdir>/hf at the end of each run, for transformers, vLLM or the next recipe.
  c.export = ml_collections.ConfigDict()
  c.export.hf = True
  # > 0: also export every this many steps to <workdir>/exports/step_NNNNNN (the full model
  # each time), to score the run's course with `rlax-ps eval`.
  c.export.every_steps = 0
  c.export.max_to_keep = 0  # > 0: the newest this many of them kept, older ones deleted.
  c.export.dtype = ""  # "" = the params' dtype; bfloat16 halves float32 exports.
  # "fp8": each layer's projections in block-scaled FP8 as DeepSeek-V3 ships (vLLM and
  # SGLang serve it as it is), the rest in export.dtype; "fp8_ue8m0": so with power-of-two
  # scales as DeepSeek-V3.1 ships; "mxfp4": gpt-oss's experts in MXFP4 as it ships; "" = none.
  c.export.quantization = ""

  # Held-out evaluation: greedy exact match every every_steps and at the end, and
  # pass@1 / pass@pass_k with the workers' temperature at the end.
  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 25
  c.eval.num_examples = 200  # Per task.
  c.eval.batch_size = 200
  c.eval.seed = 1234  # The same held-out examples as the warm start's evaluation.
  c.eval.pass_k = 8
  # The trainer's held-out decoding budget; 0 = worker.max_new_tokens for data.heldout_jsonl
  # or a chat template, else each task's longest answer and eos. (Evaluated on the workers,
  # the budget is theirs.)
  c.eval.max_new_tokens = 0
  # True: the workers decode the held-out prompts (one greedy answer each, scored by their
  # verifiers) between training prompts, and the trainer logs each round when it is whole,
  # at the step that fed it; the warm start's and the final evaluation (pass@pass_k too, at
  # most worker.samples_per_prompt) are theirs as well, waited for up to rl.take_timeout_s;
  # False: the trainer decodes them itself, pausing training.
  c.eval.on_workers = False
  # With on_workers: each round also samples this many answers of each held-out prompt, as
  # the workers sample (at most worker.samples_per_prompt), and logs pass@1 and pass@k of
  # them; 0: greedy answers alone.
  c.eval.rounds_pass_k = 0

  # Inference workers (inference_workers.worker_config.WorkerConfig fields).
  c.worker = ml_collections.ConfigDict()
  c.worker.weights_format = "bf16"  # Must equal publish.format.
  c.worker.samples_per_prompt = 8
  c.worker.prompts_per_lease = 8
  c.worker.prompts_per_call = 8  # Prompts decoding together; a finished one's slot takes the next.
  c.worker.rows_per_prompt = 0  # Decode rows per prompt (0: samples_per_prompt, all at once).
  # > 0: this many rows shared by every prompt's samples, a row taking the next queued
  # sample of any prompt when its own ends (prompts_per_call, rows_per_prompt then unused):
  # for long, uneven answers; this recipe's short ones run faster on slots.
  c.worker.sample_rows = 0
  c.worker.decode_chunk_steps = 32  # Most decode steps between looks at weights and leases.
  # False: a new version waits for the prompts started on the held one (a group is sampled
  # by the version it carries); True: it is applied between decode chunks at once.
  c.worker.in_flight_updates = False
  c.worker.max_new_tokens = 20
  c.worker.temperature = 1.0
  c.worker.min_p = 0.0  # > 0: drop tokens under min_p x the likeliest's probability (vLLM's).
  c.worker.lease_wait_s = 0.5
  c.worker.lease_deadline_s = 120.0
  c.worker.default_task = "addition"
  c.worker.verifiers = ""  # Python files or modules registering verifiers, comma-separated.
  # Multi-turn: an environment (e.g. "calculator", or one worker.verifiers registers) answers
  # each turn a sample ends, at most max_turns times; the trainer's loss skips its replies.
  c.worker.environment = ""
  c.worker.environment_args = ""  # its arguments as JSON, e.g. '{"timeout_s": 30}'
  c.worker.environment_timeout_s = 300.0  # a call past it is answered with a TimeoutError
  c.worker.max_turns = 4
  c.worker.environment_threads = 8  # Replies in the making at once (1: one at a time).
  c.worker.scoring_threads = 8  # Samples scored at once, of any groups (1: one at a time).
  # A reward model (an HF *ForSequenceClassification folder) scores each finished sample:
  # alone for task reward_model, added x reward_model_weight to any other task's verifier.
  c.worker.reward_model = ""
  c.worker.reward_model_weight = 0.0
  c.worker.reward_terms = ""  # e.g. "think_format:0.5": verifiers added x weight, logged apart
  # Mixture of experts: workers send each token's experts and the trainer's forward routes
  # by them (routing replay), so the experts a token goes to are the ones it was sampled with.
  c.worker.routing_replay = False
  # Every other WorkerConfig field (top_p, kv_cache_dtype, grace_s, ...) at its default, so
  # that each can be overridden here (a worker's name and seed are its own flags).
  with_defaults(c.worker, WorkerConfig, skip=("name", "seed"))

  # `rlax-ps local`: how many workers to start.
  c.local = ml_collections.ConfigDict()
  c.local.workers = 2
  # The workers' JAX platform: "cpu" leaves this machine's accelerators to the trainer (a
  # TPU host's chips take one process); "" = JAX's default: on one GPU the trainer and the
  # workers share it (none preallocates; the run measured in benchmarks/README.md).
  c.local.worker_platform = "cpu"
  # This host's chips split between the processes (both > 0, or 0 = off): the trainer gets
  # chips 0..trainer_chips-1 and each worker the next chips_per_worker, found from /dev
  # (worker_platform is then not used). A GPU host: GPUs by CUDA_VISIBLE_DEVICES, any
  # counts. A TPU host (v4-8, v5litepod-8, v6e-8, ...): TPU chips by libtpu's
  # TPU_VISIBLE_CHIPS and sub-slice settings, 1, 2 or 4 chips a process, each starting at a
  # multiple of its count (trainer_chips a multiple of chips_per_worker). A worker decodes
  # on worker.devices of its chips: set it to 0 (all) with more than one.
  c.local.trainer_chips = 0
  c.local.chips_per_worker = 0
  # The parameter server's Prometheus metrics (`rlax-ps serve --metrics_port`, no token) on
  # http://127.0.0.1:PORT/metrics; 0 = any free port (the URL is printed); -1 = off.
  c.local.metrics_port = -1
  # More `rlax-ps serve` flags for the run's server, space-separated (e.g.
  # "--max_message_bytes=268435456" for long responses with routing replay).
  c.local.serve_flags = ""
  # On Ctrl-C or a child's failure: how long the trainer may take to finish its step and
  # write its checkpoint before it is killed (the steps since the last one are then redone).
  c.local.trainer_grace_s = 120.0

  if arg == "tiny":
    c.rl.steps = 4
    c.rl.max_seconds = 0.0
    c.rl.groups_per_step = 4
    c.rl.max_prompt_tokens = 16
    c.rl.take_timeout_s = 120.0
    c.worker.samples_per_prompt = 4
    c.worker.prompts_per_lease = 2
    c.worker.prompts_per_call = 2
    c.worker.max_new_tokens = 8
    # The 4-step warm start answers nothing: a length penalty over the whole budget gives
    # rewards that vary within groups, so the smoke run's weights move and sync real deltas.
    c.loss.overlong_buffer = c.worker.max_new_tokens
    c.checkpoint.every_steps = 2
    c.eval.every_steps = 0
    c.eval.num_examples = 8
    c.eval.batch_size = 8
    c.eval.pass_k = 2
    c.log.completions_every = 2
  return c
