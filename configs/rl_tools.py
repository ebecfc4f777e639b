r"""rlax-ps local --config=configs/rl_tools.py --workdir=runs/tools \
    --config.init_from_hf=PATH --config.data.jsonl=train.jsonl --config.data.heldout_jsonl=test.jsonl

Multi-turn RL with a tool: configs/rl_instruct.py (your instruct checkpoint, math questions
with reference answers, GRPO), where each turn the policy ends is answered by the calculator
environment. A turn holding `<calc>12*(3+4)</calc>` gets `<result>84</result>` back as a tool
message (a user message where the chat template has no tool role) and the policy goes on;
a turn without a call ends the sample, which the `math` verifier scores as a whole. Tell the
model about the tool in each record's prompt, e.g. a system message: "To compute, write
<calc>expression</calc> and end your turn; the result comes back as <result>value</result>.
Put your final answer within \boxed{}." The trainer takes the policy's tokens as actions and
the tool's replies as context only (no loss on them); held-out questions are answered in as
many turns as the workers allow.

Several calls in one turn get one result message each.
A code interpreter instead: --config.worker.environment=python (a turn's ```python blocks run
in a sandbox, after the earlier turns' blocks, and their printout comes back as
<output>...</output>; algorithms/verifiers/code_exec.py says what the sandbox does not stop:
run workers as root, so the code runs as nobody).
Your own functions through the model's native tool calling (Qwen / Hermes <tool_call>,
Llama 3.1+ and Mistral JSON calls):
`@register_tool` on typed, documented functions in my_tools.py (run in the worker, cut at
--config.worker.environment_args='{"timeout_s": 30}'), then
--config.worker.verifiers=my_tools.py --config.tokenizer.tools=name,... (offered in every
prompt through the chat template: one that reads `tools`, as Qwen's and Llama 3.1's do;
Gemma's does not, and is refused) --config.worker.environment=tool_calls.
Your own environment: `@register_environment("name")` on a class or factory in a file
(algorithms.environments), then --config.worker.verifiers=my_env.py
--config.worker.environment=name. Mixed data, each task its own (or none, single-turn):
--config.worker.environment='math=python,addition=calculator' (tasks of the records).
`:tiny` is the seconds-long smoke variant (the tests').
"""

import ml_collections

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = sibling(__file__, "rl_instruct.py", arg)
  c.worker.environment = "calculator"
  c.worker.max_turns = 4  # tool replies per answer; the whole conversation fits max_new_tokens
  c.worker.max_new_tokens = 1536
  c.loss.overlong_buffer = 384
  if arg == "tiny":
    c.worker.max_new_tokens = 16
    c.worker.max_turns = 2
    c.loss.overlong_buffer = 2
  return c
