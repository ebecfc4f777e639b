r"""rlax-ps local --config=configs/rl_moe.py --workdir=runs/moe \
    --config.init_from_hf=PATH --config.data.jsonl=train.jsonl --config.data.heldout_jsonl=test.jsonl

RL post-training of a mixture-of-experts instruct checkpoint (Qwen3-30B-A3B, Qwen1.5/2-MoE,
Mixtral, gpt-oss): configs/rl_instruct.py with what MoE RL needs on top.
- Routing replay (worker.routing_replay): workers send the experts each token went to and
  the trainer routes by them, so the ratios it trains on compare weights, not two routers
  that flip between near-equal experts (train/router_agreement shows how often its own
  routers would pick alike).
- int8 publication (publish.format, worker.weights_format): experts are most of an MoE's
  bytes, so workers hold them as int8 (scales per expert and channel; routers stay bf16),
  and truncated importance sampling corrects the rounding gap (loss.correction=tis).
- The load-balancing loss at transformers' usual 0.001 (loss.router_aux_coef), so RL does
  not collapse the routing onto a few experts.
- Expert parallelism (model.expert_parallel): each chip of the fsdp axis holds whole
  experts and the tokens routed to them travel, instead of every layer gathering all the
  experts' weights (mesh.fsdp must divide the expert count: the trainer refuses another).
A long response's routes take layers x top_k bytes per token: raise the server's message
limit for thinking-length responses (--config.local.serve_flags=--max_message_bytes=N, or
`rlax-ps serve --max_message_bytes=N` on separate machines). `:tiny` is the smoke variant.
"""

from rlax_ps.config_files import sibling


def get_config(arg: str | None = None):
  c = sibling(__file__, "rl_instruct.py", arg)
  c.worker.routing_replay = True
  c.publish.format = "int8"
  c.worker.weights_format = "int8"
  c.loss.correction = "tis"
  c.loss.router_aux_coef = 0.001
  c.model.expert_parallel = True
  return c
