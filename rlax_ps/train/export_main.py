r"""`rlax-ps export`: any checkpoint of a run as a Hugging Face checkpoint, without resuming it.

  rlax-ps export --workdir=runs/rl_local                  # its latest step, in <workdir>/hf-step-N
  rlax-ps export --workdir=runs/rl_local/sft --step=200 --out=/tmp/sft-200

--workdir is a trainer's run folder: that of `rlax-ps train` or `rlax-ps sft`, or of
`rlax-ps local` (its RL trainer's; the warm start's is <workdir>/sft). The files are those
the trainer's own export writes (export.dtype, config.json, generation config, tokenizer
files and chat template, LoRA adapters merged; --peft: also the PEFT adapter), and a
rlax_ps_export.json naming the run and step. The run's config and model come from the
checkpoint, not from a --config. The run is only read (no lock, nothing written in it but the
default --out), so a run may go on training meanwhile; the params alone are read, onto one
device (the CPU unless JAX_PLATFORMS names another platform), whatever mesh trained them.
A run moved or copied elsewhere is exported where it lies: the paths its config recorded in
its old folder (checkpoint.directory, a warm start's init_from_hf) are read in --workdir.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import flags, logging

from rlax_ps.config_files import user_path

_WORKDIR = flags.DEFINE_string("workdir", None, "A trainer's run folder: the --workdir of "
                               "`rlax-ps train`, `rlax-ps sft` or `rlax-ps local`.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step to export (default: the "
                             "latest complete one).")
_OUT = flags.DEFINE_string("out", "", "Folder to write (default <workdir>/hf-step-N). An earlier "
                           "export of the same step there is replaced; any other files refuse it.")
_PEFT = flags.DEFINE_bool("peft", False, "A LoRA run: also write its adapters as a PEFT adapter "
                          "in <out>/adapter, as the trainer's export does.")
_QUANTIZATION = flags.DEFINE_string(
    "quantization", None, "'fp8': the projections in block-scaled FP8 (DeepSeek-V3's layout, "
    "which vLLM and SGLang serve), the rest in export.dtype; 'fp8_ue8m0': so with scales "
    "that are powers of two (DeepSeek-V3.1's); 'mxfp4': gpt-oss's experts in MXFP4, as "
    "gpt-oss ships; '': none (default: the run's export.quantization).")
flags.mark_flags_as_required(["workdir"])


def _saved_run_config(workdir: str) -> dict[str, Any]:
  """The run_config.json of `workdir` (an SFT run writes one), or {}."""
  from rlax_ps.config_files import RUN_CONFIG
  path = os.path.join(workdir, RUN_CONFIG)
  if not os.path.isfile(path):
    return {}
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"--workdir: cannot read {path}: {e}") from None


def checkpoints_of(workdir: str) -> str:
  """Where the run in `workdir` checkpoints: its run_config.json's checkpoint.directory, else
  <workdir>/checkpoints (as the trainers choose)."""
  import ml_collections

  from rlax_ps.train.run import checkpoint_directory
  block = dict(_saved_run_config(workdir).get("checkpoint") or {})
  if block.get("directory"):
    block["directory"] = moved_path("checkpoint.directory", str(block["directory"]), workdir)
  return checkpoint_directory(ml_collections.ConfigDict({"checkpoint": block}), workdir)


# The fields of a run's config that name a file or folder the export reads.
PATH_FIELDS = ("init_from_hf", "tokenizer.path", "tokenizer.chat_template")


def moved_path(field: str, recorded: str, workdir: str) -> str:
  """Where config `field`'s `recorded` path lies for the run now in `workdir` (moved or copied
  since): a path inside the run's old folder at the same place in `workdir`, any other as
  recorded; ValueError naming `field` where it is gone. The old folder is not recorded: it is
  the folder above `recorded` holding the same run_config.json (a copy's original), else, where
  `recorded` is gone, the one above it whose longest tail of `recorded` exists in `workdir`."""
  if not recorded or "://" in recorded or (field == "tokenizer.chat_template"
                                           and recorded == "auto"):
    return recorded
  workdir, path = os.path.abspath(workdir), os.path.abspath(recorded)
  parts = path.strip(os.sep).split(os.sep)
  record = _run_config_bytes(workdir)
  for i in range(len(parts) - 1, 0, -1):  # the folders above `path`, nearest first
    old = os.sep + os.path.join(*parts[:i])
    if old == workdir:
      return recorded  # in the run's folder already
    if record is not None and _run_config_bytes(old) == record:
      return os.path.join(workdir, *parts[i:])
  if os.path.exists(path):
    return recorded
  for i in range(len(parts)):  # the longest tail first
    here = os.path.join(workdir, *parts[i:])
    if os.path.exists(here):
      return here
  raise ValueError(f"{field}: {recorded}, as the run recorded it, is not found, nor at its place "
                   f"in --workdir {workdir}; put it back there, or into --workdir where it lay "
                   f"in the run's folder")


def _run_config_bytes(folder: str) -> bytes | None:
  """The bytes of `folder`'s run_config.json, None where it has none."""
  from rlax_ps.config_files import RUN_CONFIG
  try:
    with open(os.path.join(folder, RUN_CONFIG), "rb") as f:
      return f.read()
  except OSError:
    return None


def moved_config(config, workdir: str):
  """`config` with its PATH_FIELDS where they lie for the run now in `workdir` (moved_path)."""
  config = config.copy_and_resolve_references()
  for field in PATH_FIELDS:
    block, _, key = field.rpartition(".")
    parent = config.get(block) if block else config
    recorded = str(parent.get(key) or "") if parent is not None else ""
    moved = moved_path(field, recorded, workdir)
    if moved != recorded:
      parent[key] = moved
  return config


def open_reader(workdir: str):
  """The checkpoints of the run in `workdir`, read only; ValueError naming
  --workdir where it is no run folder, has no complete checkpoint, or cannot be read."""
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir: {workdir} is not a folder")
  directory = checkpoints_of(workdir)
  if "://" not in directory and not os.path.isdir(directory):
    raise ValueError(f"--workdir: no checkpoints in {workdir} ({directory} not found); expected "
                     f"the --workdir of `rlax-ps train`, `rlax-ps sft` or `rlax-ps local`")
  try:
    from rlax_ps.checkpoint import Checkpointer  # orbax (and JAX) load once flags parse
    reader = Checkpointer(directory, read_only=True)
    steps = reader.all_steps()
  except OSError as e:
    raise ValueError(f"--workdir: cannot read {directory}: {e.strerror or e}") from None
  if not steps:
    reader.close()
    raise ValueError(f"--workdir: no complete checkpoint in {directory}")
  return reader


def chosen_step(steps: list[int], step: int | None, directory: str) -> int:
  """`step` (None: the latest of `steps`); ValueError naming --step and the saved ones when it
  is not saved."""
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ValueError(f"--step: {step} is not saved in {directory}; saved steps: "
                     f"{', '.join(map(str, steps))}")
  return step


def check_out(out: str, record: dict[str, Any]) -> None:
  """ValueError naming --out unless `out` is absent, an empty folder, or an earlier export of
  the same step of the same run (its EXPORT_RECORD is `record`), and the folders an export
  writes beside it (.partial, .old) are absent, empty or this command's: nothing else is
  written over."""
  from rlax_ps.train.run import EXPORT_RECORD
  for aside in (out.rstrip("/") + ".partial", out.rstrip("/") + ".old"):
    if os.path.lexists(aside) and (not os.path.isdir(aside) or (
        os.listdir(aside) and not os.path.exists(os.path.join(aside, EXPORT_RECORD)))):
      raise ValueError(f"--out: {aside} holds no export of `rlax-ps export`, and an export "
                       f"to {out} writes {out}.partial and moves an earlier one to {out}.old "
                       f"(both deleted after); move it, or name another folder")
  if not os.path.lexists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f"--out: {out} is a file, expected a folder")
  names = sorted(os.listdir(out))
  if not names:
    return
  try:
    with open(os.path.join(out, EXPORT_RECORD)) as f:
      was = json.load(f)
  except (OSError, ValueError):
    was = None
  if was == record:
    return
  if not isinstance(was, dict):
    raise ValueError(f"--out: {out} is not empty ({', '.join(names[:3])}"
                     f"{', ...' if len(names) > 3 else ''}) and holds no export of `rlax-ps "
                     f"export`; name a new or empty folder")
  raise ValueError(f"--out: {out} holds the export of step {was.get('step')} of "
                   f"{was.get('checkpoints')}, not of step {record['step']} of "
                   f"{record['checkpoints']}; name another folder, or delete it")


def checkpoint_params(reader, step: int, model_config, device) -> tuple[Any, Any]:
  """(graphdef, params on `device`) of checkpoint `step` of a `model_config` model; the
  checkpoint's other state (optimizer moments, a reference) is not read."""
  import jax

  from rlax_ps.train.state import abstract_model
  graphdef, abstract, _ = abstract_model(model_config)
  where = jax.sharding.SingleDeviceSharding(device)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                        abstract)
  return graphdef, reader.restore_params(target, step)


def _run_of(saved: dict[str, Any], workdir: str, step: int):
  """(config, model config) that checkpoint `step` records (its config, else the workdir's
  run_config.json); ValueError naming --workdir where it records none."""
  import ml_collections

  from rlax_ps.models import ModelConfig
  config = saved.get("config") or _saved_run_config(workdir)
  if not config or not saved.get("model_config"):
    raise ValueError(f"--workdir: checkpoint step {step} records no "
                     f"{'config' if not config else 'model_config'}: not a checkpoint of "
                     f"`rlax-ps train`, `sft` or `local`")
  return (moved_config(ml_collections.ConfigDict(config), workdir),
          ModelConfig.from_dict(saved["model_config"]))


def check_peft(model_config) -> None:
  """ValueError naming --peft unless the model's adapters can be written as a PEFT adapter."""
  from rlax_ps.models.peft import peft_adapter_names
  try:
    peft_adapter_names(model_config)
  except ValueError as e:
    raise ValueError(f"--peft: the run's model has no adapters PEFT can hold ({e})") from None


def export_checkpoint(workdir: str, step: int | None = None, out: str = "",
                      peft: bool = False, quantization: str | None = None) -> tuple[int, str]:
  """(step, folder) of the Hugging Face export of checkpoint `step` (None: the latest) of the
  run in `workdir` to `out` (default <workdir>/hf-step-N), as the trainer's export writes it
  (run.write_hf_export) with an EXPORT_RECORD; `peft`: also the PEFT adapter;
  `quantization` (None: the run's export.quantization) as save_hf_checkpoint's. ValueError
  naming the flag (--workdir, --step, --out, --peft, --quantization) for input it refuses."""
  import jax

  from rlax_ps.models.hf import QUANTIZATIONS
  from rlax_ps.train.run import write_hf_export
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ValueError(f"--quantization: expected one of {QUANTIZATIONS} ('': none), got "
                     f"{quantization!r}")
  workdir = user_path(workdir, "--workdir")
  given, out_given = step, out
  with open_reader(workdir) as reader:
    for _ in range(_RETRIES):  # a running trainer deletes old steps as it saves new ones
      step = chosen_step(reader.all_steps(), given, reader.directory)
      out = user_path(out_given or os.path.join(workdir, f"hf-step-{step}"), "--out")
      record = {"checkpoints": reader.directory, "step": step}
      check_out(out, record)
      try:
        (config, model_config, options, tokenizer, graphdef, params) = _read_step(
            reader, workdir, step, peft, quantization)
        break
      except _Unread as e:
        reader.reload()
        if step in reader.all_steps():  # a damaged step: which, and what deleting it does
          raise ValueError(f"--step: {e}") from None
        if given is not None:
          raise ValueError(f"--step: step {step} was deleted while it was read: the run's "
                           f"trainer keeps its newest checkpoint.max_to_keep steps; saved "
                           f"now: {', '.join(map(str, reader.all_steps()))}") from None
    else:
      raise ValueError(f"--workdir: the latest step of {reader.directory} was deleted while it "
                       f"was read {_RETRIES} times over (checkpoint.max_to_keep=1 and a step "
                       f"saved faster than it is read?); pass --step, or export after the run")
  try:
    path = write_hf_export(graphdef, jax.device_get(params), tokenizer, out,
                           **options, peft=peft,
                           base_model=str(config.get("init_from_hf", "")), record=record)
  except OSError as e:
    raise ValueError(f"--out: cannot write {out}: {e.strerror or e}") from None
  return step, path


_RETRIES = 5  # latest steps read while a running trainer deleted them


class _Unread(Exception):
  """A step's files could not be read: damaged, or deleted meanwhile (the caller tells which)."""


def _read_step(reader, workdir: str, step: int, peft: bool, quantization: str | None):
  """(config, model config, export options, tokenizer, graphdef, params) of checkpoint
  `step`; ValueError naming the flag for what it refuses, _Unread where the step cannot be
  read."""
  import jax

  from rlax_ps.models.hf import check_quantization
  from rlax_ps.train.run import export_options, run_tokenizer
  try:
    saved = reader.metadata(step)
  except ValueError as e:
    raise _Unread(str(e)) from None
  config, model_config = _run_of(saved, workdir, step)
  options = export_options(config)
  if quantization is not None:
    options["quantization"] = quantization
    try:
      check_quantization(quantization, model_config.architecture)
    except ValueError as e:
      raise ValueError(f"--{e}") from None
  if peft:
    check_peft(model_config)
  try:
    tokenizer = run_tokenizer(config)
  except (OSError, ValueError) as e:
    raise ValueError(f"--workdir: the run's tokenizer (its config's `tokenizer` block): "
                     f"{e}") from None
  try:
    graphdef, params = checkpoint_params(reader, step, model_config, jax.local_devices()[0])
  except ValueError as e:
    raise _Unread(str(e)) from None
  return config, model_config, options, tokenizer, graphdef, params


def main(argv: list[str]) -> None:
  if not flags.FLAGS["verbosity"].present:  # orbax warns that it opens the checkpoints read only
    logging.set_verbosity(logging.ERROR)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: no accelerator is touched
  from rlax_ps.train.run import built_or_exit
  step, path = built_or_exit("rlax-ps export", lambda: export_checkpoint(
      _WORKDIR.value, _STEP.value, _OUT.value, _PEFT.value, _QUANTIZATION.value))
  print(f"Hugging Face export of step {step}: {path}", flush=True)
