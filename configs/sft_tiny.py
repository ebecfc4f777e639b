r"""rlax-ps sft --config=configs/sft_tiny.py --workdir=runs/sft_tiny

Supervised warm start from scratch on the built-in addition and string-reversal tasks: a
small Llama-style model, character tokenizer, packed rows, held-out exact match at the end.
This is the embedded default of `make run`: about a minute on 2 idle CPU cores (three on
busy ones; compiles included), reaching a partial held-out exact match, a starting point
for RL: 49.5% to 59% (addition 13% to 30%, reversal 86% to 89%, by host) after the default
400 steps. More steps keep improving it: `--config.train.steps=1000` gives 94% (addition
98%, reversal 89%).

Variants:
  configs/sft_tiny.py        the `make run` default (CPU, minutes).
  configs/sft_tiny.py:tiny   seconds: a smoke test of the whole path (used by the tests).

Override any field from the command line, e.g.
  rlax-ps sft --config=configs/sft_tiny.py:tiny --config.optimizer.lr=1e-3 --workdir=/tmp/x
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds params init and the training data stream.
  # Start from a Hugging Face checkpoint folder instead of random init ("" = from scratch):
  # its config.json replaces the `model` block (except the dtypes) and, with
  # tokenizer.kind="hf" and no tokenizer.path, its tokenizer.json is used.
  c.init_from_hf = ""

  # Tokenizer: "char" (built-in, ids for printable ASCII) or "hf" (a tokenizer.json).
  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.kind = "char"
  c.tokenizer.path = ""  # For kind="hf": tokenizer.json or the directory holding it.
  c.tokenizer.alphabet = ""  # For kind="char": characters to cover; "" = printable ASCII.
  # For kind="hf": "" feeds prompts as text; "auto" renders each prompt (text as one user
  # message, or a JSONL record's list of messages) with the tokenizer's chat template, or
  # name a .jinja file. chat_kwargs: template variables as JSON, e.g. '{"enable_thinking": false}'.
  c.tokenizer.chat_template = ""
  c.tokenizer.chat_kwargs = ""
  # For kind="hf": more tokens that end a sample, comma-separated (e.g. "<|im_end|>" when a
  # base model's files stop only at <|endoftext|>), beside eos and generation_config.json's.
  c.tokenizer.stop_tokens = ""
  # With a chat template: functions (@register_tool in a worker.verifiers file) offered to the
  # model in every prompt, comma-separated; worker.environment="tool_calls" runs them.
  c.tokenizer.tools = ""

  # Model (rlax_ps.models.ModelConfig fields). vocab_size 0 = the tokenizer's.
  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 0
  c.model.hidden_size = 128
  c.model.intermediate_size = 384  # SwiGLU inner width.
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2  # < num_heads: grouped-query attention.
  c.model.head_dim = 32
  c.model.rope_theta = 10000.0
  c.model.rms_norm_eps = 1e-6
  c.model.qkv_bias = False  # Qwen2: biases on q/k/v.
  c.model.qk_norm = False  # Qwen3: RMS norms on each head's q and k.
  c.model.tie_word_embeddings = False
  c.model.max_position_embeddings = 128
  c.model.param_dtype = "float32"  # float32 | bfloat16
  c.model.dtype = "float32"  # Compute dtype: float32 | bfloat16.
  c.model.architecture = "llama"  # llama|mistral|mixtral|qwen2|qwen3(_moe)|gemma2|gemma3

  # Tasks: weight > 0 includes a task in the mix; the other fields are its arguments.
  c.tasks = ml_collections.ConfigDict()
  c.tasks.addition = ml_collections.ConfigDict()
  c.tasks.addition.weight = 1.0
  c.tasks.addition.min_digits = 1
  c.tasks.addition.max_digits = 2
  c.tasks.addition.heldout_fraction = 0.1  # Share of all prompts kept for evaluation.
  c.tasks.reversal = ml_collections.ConfigDict()
  c.tasks.reversal.weight = 1.0
  c.tasks.reversal.min_len = 1
  c.tasks.reversal.max_len = 16
  c.tasks.reversal.heldout_fraction = 0.1

  # Training data.
  c.data = ml_collections.ConfigDict()
  c.data.batch_size = 32  # Rows per update (global, over all devices).
  c.data.seq_len = 64  # Tokens per row.
  c.data.packing = True  # Several examples per row (else one example per row, padded).
  # Train on a JSONL or Parquet file (a path or a URL) of {"prompt", "answer"} records
  # (prompts as text or chat messages) instead of the tasks; the keys read other columns.
  # The loss is on the answer and eos.
  c.data.jsonl = ""
  # Several files (comma-joined) mixed: one weight a file ("3,1"); "" = their records as one
  # set.
  c.data.weights = ""
  # Held-out records, each answer one reference string (no demonstration), scored by their
  # task's verifier (else math) instead of the tasks' held-out split.
  c.data.heldout_jsonl = ""
  c.data.prompt_key = "prompt"
  c.data.answer_key = "answer"
  c.data.task_key = "task"
  # A rerun on data other than its checkpoint's is refused; True trains on the new data
  # instead (RL: from its first record).
  c.data.allow_new_source = False

  # Optimizer (rlax_ps.optim): AdamW + clipping + warmup/cosine + accumulation.
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.lr = 3e-3  # Peak learning rate.
  c.optimizer.warmup_steps = 50
  c.optimizer.decay_steps = 0  # 0 = train.steps.
  c.optimizer.min_lr_ratio = 0.1  # Final lr = lr * min_lr_ratio.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.98
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.01  # On matrices only.
  c.optimizer.clip_norm = 1.0  # Global-norm clip; 0 disables.
  c.optimizer.max_nonfinite_steps = 5  # Updates skipped for NaN/inf gradients in a row: stop.
  c.optimizer.grad_accum_steps = 1  # Micro-batches per update; divides data.batch_size.

  # Device mesh: sizes of (data, fsdp, tensor); one may be -1 = all remaining devices.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1

  # Training loop.
  c.train = ml_collections.ConfigDict()
  c.train.steps = 400  # Updates in all.
  c.train.log_every = 25  # Steps between TensorBoard scalars / progress-bar updates.
  c.train.eval_every = 0  # Steps between held-out evaluations; 0 = only at the end.

  # Held-out evaluation: greedy decoding, exact match after the "=".
  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 200  # Per task.
  c.eval.batch_size = 200  # Prompts decoded together.
  c.eval.seed = 1234  # Which held-out examples (fixed across runs for comparability).
  # data.heldout_jsonl's decoding budget; 0 = each set's longest answer and eos (set it for
  # answers a model reasons its way to: a short reference then leaves it no room).
  c.eval.max_new_tokens = 0

  # Orbax checkpoints; a rerun resumes from the latest.
  c.checkpoint = ml_collections.ConfigDict()
  # "" = <workdir>/checkpoints; on a multi-host slice, storage every host sees (gs://...).
  c.checkpoint.directory = ""
  c.checkpoint.every_steps = 200  # 0 = only at the end.
  c.checkpoint.max_to_keep = 2
  c.checkpoint.async_save = True

  # Weights & Biases (pip install 'rlax-ps[wandb]'): the run's scalars go to this project too
  # (TensorBoard in <workdir>/tb always); a resumed run goes on in the same W&B run.
  # WANDB_MODE=offline keeps it on disk for `wandb sync`.
  c.wandb = ml_collections.ConfigDict()
  c.wandb.project = ""  # "" = off
  c.wandb.entity = ""  # "" = your default entity
  c.wandb.group = ""

  # Export at the end: Hugging Face format (config.json + model.safetensors + tokenizer)
  # under <workdir>/hf, loadable by transformers / vLLM.
  c.export = ml_collections.ConfigDict()
  c.export.hf = True
  c.export.dtype = ""  # "" = the params' dtype; bfloat16 halves float32 exports.
  # "fp8": each layer's projections in block-scaled FP8 as DeepSeek-V3 ships (vLLM and
  # SGLang serve it as it is), the rest in export.dtype; "fp8_ue8m0": so with power-of-two
  # scales as DeepSeek-V3.1 ships; "mxfp4": gpt-oss's experts in MXFP4 as it ships; "" = none.
  c.export.quantization = ""

  if arg == "tiny":
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_layers = 1
    c.model.head_dim = 8
    c.data.batch_size = 8
    c.data.seq_len = 32
    c.tasks.reversal.max_len = 6
    c.train.steps = 4
    c.train.log_every = 2
    c.optimizer.warmup_steps = 2
    c.eval.num_examples = 8
    c.eval.batch_size = 8
    c.checkpoint.every_steps = 2
  elif arg:
    raise ValueError(f"configs/sft_tiny.py: unknown variant {arg!r}; expected '' or 'tiny'")
  return c
