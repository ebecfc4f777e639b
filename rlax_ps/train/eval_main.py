r"""`rlax-ps eval`: held-out accuracy of Hugging Face checkpoints, side by side.

  rlax-ps eval --config=configs/rl_local.py \
      --checkpoints=runs/rl_local/sft/hf,runs/rl_local/hf [--output=eval.json]

The config names the held-out set and how it is scored, as the trainer's does: the built-in
tasks' held-out split (`tasks`, `eval.num_examples`, `eval.seed`), or `data.heldout_jsonl`
scored by its tasks' verifiers (`worker.verifiers`, decoding up to `worker.max_new_tokens`);
greedy exact match, then pass@1 and pass@`eval.pass_k` sampled at `worker.temperature`. Each
checkpoint's config.json gives its shape and its tokenizer.json its tokenizer (else the
config's `tokenizer`, as does `tokenizer.path` when set); the config's `model` dtypes apply.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Recipe naming the held-out set, e.g. configs/rl_local.py; override "
    "fields with --config.a.b=value.", lock_config=True)
_CHECKPOINTS = flags.DEFINE_list("checkpoints", None, "Hugging Face checkpoint folders, "
                                 "comma-separated (e.g. the warm start and the RL export).")
_OUTPUT = flags.DEFINE_string("output", "", "Also write the results as JSON here.")
flags.mark_flags_as_required(["config", "checkpoints"])


@flags.validator("checkpoints")
def _checkpoints_exist(paths) -> bool:
  missing = [p for p in paths or [] if not os.path.isfile(os.path.join(p, "config.json"))]
  if missing or not paths:
    raise flags.ValidationError(f"expected Hugging Face checkpoint folders (with a "
                                f"config.json), not found: {', '.join(missing) or '(none)'}")
  return True


def evaluate_checkpoint(config, path: str) -> dict[str, Any]:
  """{"heldout_exact_match": {name: rate, "all": rate}, "heldout_pass": {"pass@1", "pass@k"}
  or None} of the checkpoint at `path`, as the trainers compute them."""
  from flax import nnx

  from rlax_ps.models import load_hf_checkpoint
  from rlax_ps.tokenizers import tokenizer_from_config
  from rlax_ps.train import heldout as heldout_lib
  from rlax_ps.train.run import tasks_from

  block = dict(config.tokenizer.items())
  if not block.get("path") and os.path.isfile(os.path.join(path, "tokenizer.json")):
    block.update(kind="hf", path=path)  # the checkpoint's own (exports carry theirs)
  tokenizer = tokenizer_from_config(block, path,
                                    str(config.get("worker", {}).get("verifiers", "")))
  model = load_hf_checkpoint(path, dtype=config.model.param_dtype,
                             compute_dtype=config.model.dtype)
  graphdef, params, _ = nnx.split(model, nnx.Param, ...)
  params = params.to_pure_dict()
  heldout = heldout_lib.heldout_from_config(config, tasks_from(config.tasks)[0], tokenizer)
  return {"heldout_exact_match": heldout_lib.exact_match(graphdef, params, tokenizer, heldout,
                                                         config),
          "heldout_pass": heldout_lib.pass_at_k(graphdef, params, tokenizer, heldout, config)}


def table(results: dict[str, dict[str, Any]]) -> str:
  """One column per checkpoint: exact match (a reward model's: its score) per name, then
  pass@1 and pass@k."""
  from rlax_ps.local import heldout_cell
  paths = list(results)
  names = []
  for r in results.values():
    names += [n for n in r["heldout_exact_match"] if n not in names and n != "all"]
  scores = dict.fromkeys(names)
  what = "score" if "reward_model" in scores else "exact match"
  rows = [("held-out", *["/".join(pathlib.PurePath(p).parts[-2:]) for p in paths])]
  for name in names + ["all"]:
    rows.append((f"{what} {name}", *[heldout_cell(results[p]["heldout_exact_match"].get(name),
                                                  scores) for p in paths]))
  for key in (results[paths[0]]["heldout_pass"] or {}):
    rows.append((key, *[heldout_cell((results[p]["heldout_pass"] or {}).get(key), scores)
                        for p in paths]))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise SystemExit(f"rlax-ps eval: unexpected arguments {argv[1:]}; flags are --name=value")
  from rlax_ps.compile_cache import enable_compile_cache
  enable_compile_cache()
  results = {p: evaluate_checkpoint(_CONFIG.value, p) for p in _CHECKPOINTS.value}
  print(table(results), flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump(results, f, indent=1)
    print(f"results: {_OUTPUT.value}", flush=True)
