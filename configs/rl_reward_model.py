r"""rlax-ps local --config=configs/rl_reward_model.py --workdir=runs/rlhf \
    --config.init_from_hf=PATH --config.worker.reward_model=RM_PATH --config.data.jsonl=prompts.jsonl

RL from a reward model (RLHF): configs/rl_instruct.py (your instruct checkpoint, GRPO),
with prompts alone, `{"prompt"}` records (a prompt may be a list of chat messages), scored
by a reward model instead of a verifier. `worker.reward_model` names a Hugging Face
`*ForSequenceClassification` checkpoint of a family rlax-ps reads (Qwen3, Llama, Gemma, ...,
e.g. a Skywork-Reward-V2 model); each worker loads it beside the policy and scores every
finished sample: the conversation rendered by the reward model's own chat template (prompt,
answer, and any tool turns), or, where its folder has no tokenizer, the policy's very ids.
GRPO normalises the scores within each group, so their scale does not matter.

Held out: `--config.data.heldout_jsonl=heldout.jsonl` (prompts alone too): the trainer
loads the reward model as well and reports its mean score of the greedy answers (pass@k:
the mean best-of-k score) before, during (eval.every_steps) and after the run; without one,
watch the rollouts' mean reward in steps.jsonl and TensorBoard. To mix in verifiable
prompts, give those records a task and answer (data.answer_key; records of task
`reward_model` may leave the answer out); to add the reward model's score to a verifier's
reward, set worker.reward_model_weight.
`:tiny` is the seconds-long smoke variant (used by the tests).
"""

import ml_collections

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = sibling(__file__, "rl_instruct.py", arg)
  c.data.answer_key = ""  # prompts alone
  c.data.heldout_jsonl = ""  # prompts alone: the reward model scores the greedy answers
  c.eval.num_examples = 0  # not the built-in tasks' held-out split
  c.worker.default_task = "reward_model"
  c.worker.reward_model = ""  # required: an HF *ForSequenceClassification folder
  c.worker.reward_model_dtype = "bfloat16"
  c.worker.reward_model_batch = 16
  return c
