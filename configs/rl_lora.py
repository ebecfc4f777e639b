r"""rlax-ps local --config=configs/rl_lora.py --workdir=runs/lora \
    --config.init_from_hf=PATH --config.data.jsonl=train.jsonl --config.data.heldout_jsonl=test.jsonl

LoRA RL post-training of your instruct checkpoint: configs/rl_instruct.py with every attention
and MLP projection (and, in a mixture of experts, every expert's) adapted at rank 32 (alpha
32) and only the adapters trained. The trainer
keeps optimizer moments for the adapters alone (a fraction of a percent of the weights),
and the frozen base is held in bfloat16 (model.param_dtype; the adapters stay float32,
model.lora_dtype): a quarter of full training's state, what lets a 4B-8B model train on one
TPU host (benchmarks/rl_step_memory.py). The base is published once in the first keyframe
and every delta after it carries the adapters alone.
Workers hold the base (bf16, or int8 with --config.publish.format=int8
--config.worker.weights_format=int8) plus the adapters; the Hugging Face export in
<workdir>/hf has them merged into the kernels, and <workdir>/hf/adapter holds them alone as a
PEFT adapter (for PEFT or vLLM's LoRA serving over the base checkpoint; the dense projections'
adapters only, so not for a mixture of experts whose experts are adapted, nor one whose
gate/up/down_proj PEFT reads as its fused experts': Qwen3-MoE, GLM-4.5, OLMoE; there, attention
targets alone). LoRA learns at a higher rate than full
training (1e-5 here, 1e-6 in rl_instruct). Set model.lora_rank, model.lora_alpha and
model.lora_targets (a comma-separated subset of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,
down_proj,experts) to change them. `:tiny` is the seconds-long smoke variant (used by the tests).
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_instruct.py", arg)
  c.model.lora_rank = 32
  c.model.lora_alpha = 32.0
  c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,experts"
  c.optimizer.lr = 1e-5
  c.optimizer.weight_decay = 0.0
  c.critic.optimizer.lr = c.optimizer.get_ref("lr") * 10  # loss.advantage=gae: the critic's adapters
  c.model.param_dtype = "bfloat16"  # the frozen base; the adapters train in float32
  c.model.lora_dtype = "float32"
  if arg == "tiny":
    c.model.lora_rank = 4
    c.model.lora_alpha = 8.0
  return c
