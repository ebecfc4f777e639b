r"""`rlax-ps eval`: held-out accuracy of Hugging Face checkpoints, side by side.

  rlax-ps eval --config=configs/rl_local.py \
      --checkpoints=runs/rl_local/sft/hf,runs/rl_local/hf [--output=eval.json]

The config names the held-out set and how it is scored, as the trainer's does: the built-in
tasks' held-out split (`tasks`, `eval.num_examples`, `eval.seed`), or `data.heldout_jsonl`
scored by its tasks' verifiers (`worker.verifiers`, decoding up to `worker.max_new_tokens`);
greedy exact match, then pass@1 and pass@`eval.pass_k` sampled as the workers sample
(worker.temperature, top_k, top_p, min_p). Each checkpoint's config.json gives its shape
and its tokenizer.json its tokenizer (else the config's `tokenizer`, as does `tokenizer.path`
when set); the config's `model` dtypes apply.
Every checkpoint (its config, tensor names and tokenizer against its vocabulary), the held-out
set and each tokenizer's encoding of its prompts are checked before any checkpoint is scored.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Recipe naming the held-out set, e.g. configs/rl_local.py; override "
    "fields with --config.a.b=value.", lock_config=True)
_CHECKPOINTS = flags.DEFINE_list("checkpoints", None, "Hugging Face checkpoint folders, "
                                 "comma-separated (e.g. the warm start and the RL export).")
_OUTPUT = flags.DEFINE_string("output", "", "Also write the results as JSON here.")
flags.mark_flags_as_required(["config", "checkpoints"])


def _paths(paths) -> list[str]:
  """The --checkpoints entries, empty ones (a trailing or doubled comma) left out."""
  return [p for p in paths or [] if p.strip()]


@flags.validator("checkpoints")
def _checkpoints_exist(paths) -> bool:
  missing = [p for p in _paths(paths) if not os.path.isfile(os.path.join(p, "config.json"))]
  if missing or not _paths(paths):
    raise flags.ValidationError(f"expected Hugging Face checkpoint folders (with a "
                                f"config.json), not found: {', '.join(missing) or '(none)'}")
  return True


def checkpoint_tokenizer(config, path: str):
  """The tokenizer of the checkpoint at `path`: its own tokenizer.json (exports carry
  theirs) unless the config's `tokenizer.path` names one, else the config's tokenizer. One
  that renders prompts raw, of a checkpoint shipping a chat template, is said on stderr (an
  instruct model trained on rendered prompts scores otherwise on raw ones)."""
  from rlax_ps import chat
  from rlax_ps.tokenizers import HFTokenizer, tokenizer_file, tokenizer_from_config
  block = dict(config.tokenizer.items())
  if not block.get("path") and tokenizer_file(path):
    block.update(kind="hf", path=path)
  tokenizer = tokenizer_from_config(block, path,
                                    str(config.get("worker", {}).get("verifiers", "")))
  if (isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is None
      and chat.named_templates(os.path.dirname(tokenizer.path))):
    print(f"rlax-ps eval: {path} ships a chat template, but its prompts are scored raw "
          f"(tokenizer.chat_template=''); a model trained on prompts its template rendered "
          f"(configs/rl_instruct.py, --config.tokenizer.chat_template=auto) wants that "
          f"setting here too", file=sys.stderr, flush=True)
  return tokenizer


def check_checkpoint(config, path: str):
  """The tokenizer of the checkpoint at `path`, once its config.json and its tensors' names
  (no weights read) load and the model embeds every id of that tokenizer; else a ValueError
  naming the checkpoint, so that no checkpoint is evaluated before every one is known good."""
  from rlax_ps.models.hf import check_hf_checkpoint
  try:
    model = check_hf_checkpoint(path)
    tokenizer = checkpoint_tokenizer(config, path)
  except (ValueError, FileNotFoundError) as e:
    raise ValueError(f"checkpoint {path}: {e}") from None
  _check_vocab(tokenizer, model.vocab_size, path)
  return tokenizer


def _check_vocab(tokenizer, vocab_size: int, path: str) -> None:
  """ValueError unless the model of `path` (`vocab_size` rows) embeds every id of
  `tokenizer` (ids past its table would be clamped into it, silently), and, where it ships
  no tokenizer.json, the char tokenizer fills that table exactly (else it is another
  tokenizer's model)."""
  from rlax_ps.tokenizers import CharTokenizer, tokenizer_file
  char = isinstance(tokenizer, CharTokenizer)
  own = tokenizer_file(path) is not None
  n, kind = tokenizer.vocab_size, "char" if char else "hf"
  if char and not own and n != vocab_size:
    raise ValueError(f"checkpoint {path}: config.json vocab_size: expected {n} (the char "
                     f"tokenizer's ids), got {vocab_size}; it ships no tokenizer.json, so set "
                     f"--config.tokenizer.kind=hf --config.tokenizer.path= to its tokenizer")
  if n > vocab_size:
    raise ValueError(f"checkpoint {path}: config.json vocab_size: expected at least {n} (the "
                     f"{kind} tokenizer's ids), got {vocab_size}")


def heldout_for(config, tokenizer):
  """The config's held-out set, read with `tokenizer` (a reward model's task scores beside
  it): its records and verifiers are checked as it is made."""
  from rlax_ps.train import heldout as heldout_lib
  from rlax_ps.train.run import tasks_from
  tasks = tasks_from(config.tasks, config.data.get("heldout_jsonl", ""), "data.heldout_jsonl")
  return heldout_lib.heldout_from_config(config, tasks[0], tokenizer)


def check_prompts(heldout, tokenizer, path: str) -> None:
  """ValueError naming checkpoint `path` when its tokenizer cannot encode a held-out prompt
  (a character the char tokenizer lacks, messages without a chat template)."""
  for name, examples in heldout.examples.items():
    for example in examples:
      try:
        tokenizer.encode_prompt(example.prompt)
      except ValueError as e:
        raise ValueError(f"checkpoint {path}: held-out prompt of {name!r}: {e}") from None


def evaluate_checkpoint(config, path: str, tokenizer=None, heldout=None) -> dict[str, Any]:
  """{"heldout_exact_match": {name: rate, "all": rate}, "heldout_pass": {"pass@1", "pass@k"}
  or None} of the checkpoint at `path` (with `tokenizer`, else its own: checkpoint_tokenizer,
  on `heldout`, else heldout_for it), as the trainers compute them."""
  from flax import nnx

  from rlax_ps.models import load_hf_checkpoint
  from rlax_ps.train import heldout as heldout_lib

  tokenizer = tokenizer or checkpoint_tokenizer(config, path)
  try:
    model = load_hf_checkpoint(path, dtype=config.model.param_dtype,
                               compute_dtype=config.model.dtype)
  except ValueError as e:  # tensors that do not fit its config.json: the flag, not a traceback
    raise app.UsageError(f"--checkpoints: checkpoint {path}: {e}") from None
  graphdef, params, _ = nnx.split(model, nnx.Param, ...)
  params = params.to_pure_dict()
  heldout = heldout or heldout_for(config, tokenizer)
  return {"heldout_exact_match": heldout_lib.exact_match(graphdef, params, tokenizer, heldout,
                                                         config),
          "heldout_pass": heldout_lib.pass_at_k(graphdef, params, tokenizer, heldout, config)}


def table(results: dict[str, dict[str, Any]]) -> str:
  """One column per checkpoint: exact match (a reward model's: its score) per name, then
  pass@1 and pass@k."""
  from rlax_ps.local import heldout_cell
  paths = list(results)
  if not paths:
    return "held-out: no checkpoints evaluated"
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


def _checked(config, paths: list[str]):
  """({path: its tokenizer}, the held-out set read with the first's) once every checkpoint
  (check_checkpoint), the held-out set and each tokenizer's encoding of its prompts are
  good; else a usage error naming the flag, before any checkpoint is evaluated."""
  try:
    tokenizers = {p: check_checkpoint(config, p) for p in paths}
  except ValueError as e:
    raise app.UsageError(f"--checkpoints: {e}") from None
  try:
    first = heldout_for(config, tokenizers[paths[0]])
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(f"--config: held-out set: {e}") from None
  if not first.size:
    raise app.UsageError("--config: held-out set: no examples to evaluate (eval.num_examples "
                         "is 0, or data.heldout_jsonl has no records)")
  try:
    for p in paths:
      check_prompts(first, tokenizers[p], p)
  except ValueError as e:
    raise app.UsageError(f"--checkpoints: {e}") from None
  return tokenizers, first


def output_path(value: str) -> str:
  """--output as a path to write (user_path), its folder there and writable: checked before
  anything is evaluated; "" when not given."""
  from rlax_ps.config_files import user_path
  if not value:
    return ""
  path = user_path(value, "--output")
  folder = os.path.dirname(path)
  if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
    raise ValueError(f"--output: cannot write {path} (expected a file in a folder that exists "
                     f"and is writable)")
  return path


def main(argv: list[str]) -> None:
  from rlax_ps.compile_cache import enable_compile_cache
  enable_compile_cache()
  config, paths = _CONFIG.value, list(dict.fromkeys(_paths(_CHECKPOINTS.value)))
  try:
    output = output_path(_OUTPUT.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  tokenizers, first = _checked(config, paths)
  results = {p: evaluate_checkpoint(config, p, tokenizers[p], first if p == paths[0] else None)
             for p in paths}
  print(table(results), flush=True)
  if output:
    from rlax_ps.config_files import write_json
    write_json(output, results)  # whole or not at all
    print(f"results: {output}", flush=True)
