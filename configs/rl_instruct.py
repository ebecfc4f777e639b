r"""rlax-ps local --config=configs/rl_instruct.py --workdir=runs/instruct \
    --config.init_from_hf=PATH --config.data.jsonl=train.jsonl --config.data.heldout_jsonl=test.jsonl

RL post-training of your own instruct checkpoint (Qwen3 and Qwen3-MoE, Qwen2.5-Instruct,
Llama-3.x-Instruct, Gemma-2/3-it)
on math questions with reference answers. There is no warm start: `init_from_hf` names the
checkpoint, whose tokenizer and chat template are used. Each JSONL record
`{"prompt", "answer"}` (a prompt may be a list of chat messages; say in it how to give the
answer, e.g. "put your final answer within \boxed{}") is rendered by the chat template with
Qwen3's thinking off; workers sample 8 answers of up to 1024 tokens, the `math` verifier
scores the last \boxed{} (or "answer is") against the record's answer, and GRPO with DAPO's
clip-higher and soft overlong punishment trains on them. The trainer shards the weights over
its chips (fsdp) and computes in bfloat16.

Sized for a TPU host as trainer and a fleet of workers on other machines (`rlax-ps train` /
`rlax-ps worker` with this config; tpu_scripts/, k8s/). `rlax-ps local` runs it all on one
machine, the workers on its CPU (`local.worker_platform`). For long thinking, set
--config.tokenizer.chat_kwargs='' and raise worker.max_new_tokens and loss.overlong_buffer.
For a mixture-of-experts checkpoint add --config.worker.routing_replay=True: the trainer then
routes each token to the experts it was sampled with.
`:tiny` is the seconds-long smoke variant (used by the tests).
"""

import ml_collections

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = sibling(__file__, "rl_local.py", arg)
  # No warm start: `rlax-ps local` and `rlax-ps train` require init_from_hf.
  del c.sft
  c.tasks = ml_collections.ConfigDict()  # no built-in task: data.jsonl is required
  c.tokenizer = ml_collections.ConfigDict(dict(
      kind="hf", path="", alphabet="",  # path "": the checkpoint's tokenizer.json
      chat_template="auto", chat_kwargs='{"enable_thinking": false}', stop_tokens="",
      tools=""))
  # The checkpoint gives the shape; these set the trainer's dtypes.
  c.model = ml_collections.ConfigDict(dict(param_dtype="float32", dtype="bfloat16"))
  c.mesh.data, c.mesh.fsdp = 1, -1

  c.rl.steps = 1000
  c.rl.max_seconds = 0.0
  c.rl.groups_per_step = 64
  c.rl.max_prompt_tokens = 512
  c.rl.take_timeout_s = 1800.0
  # Memory: 8 slices of 8 groups (one packed row of up to 512 + 8 * 1024 tokens per chip of
  # a v5e-8), and 1024 response positions projected to the vocabulary at a time.
  c.rl.micro_batches = 8
  c.loss.logits_chunk = 1024
  c.loss.remat = True

  c.worker.default_task = "math"
  c.worker.samples_per_prompt = 8
  c.worker.prompts_per_lease = 8
  # 128 decode rows: 32 prompts at a time, each drawing its 8 answers on 4 rows (a row
  # takes the next answer when its own ends), so a few long answers leave no row idle.
  c.worker.prompts_per_call = 32
  c.worker.rows_per_prompt = 4
  # Every chip of a worker's VM: the 32 slots split over them, a copy of the model on each
  # (worker.tensor_parallel > 1 splits a model one chip cannot hold over that many).
  c.worker.devices = 0
  c.worker.max_new_tokens = 1024
  c.worker.lease_deadline_s = 900.0
  c.loss.overlong_buffer = 256  # DAPO's soft punishment over the last quarter of the budget

  c.optimizer.lr = 1e-6
  c.optimizer.warmup_steps = 10
  c.optimizer.weight_decay = 0.01
  c.critic.optimizer = ml_collections.ConfigDict(c.optimizer.to_dict())  # loss.advantage=gae:
  c.critic.optimizer.lr = c.optimizer.get_ref("lr") * 10  # verl's critic 1e-5 beside its actor's 1e-6
  c.checkpoint.every_steps = 20
  c.checkpoint.async_save = True  # steps go on while a save is written; acks wait for it
  c.eval.every_steps = 50
  c.eval.batch_size = 64
  c.eval.pass_k = 4
  c.local.workers = 1
  c.export.dtype = "bfloat16"  # as instruct checkpoints ship, for vLLM / transformers

  if arg == "tiny":
    c.rl.steps = 2
    c.rl.groups_per_step = 2
    c.rl.micro_batches = 2
    c.loss.logits_chunk = 4
    c.rl.max_prompt_tokens = 64
    c.rl.take_timeout_s = 120.0
    c.worker.samples_per_prompt = 2
    c.worker.prompts_per_lease = 2
    c.worker.prompts_per_call = 2
    c.worker.rows_per_prompt = 1
    c.worker.max_new_tokens = 8
    c.worker.lease_deadline_s = 120.0
    c.loss.overlong_buffer = 2
    c.checkpoint.every_steps = 1
    c.eval.every_steps = 0
    c.eval.batch_size = 8
    c.eval.pass_k = 2
  return c
