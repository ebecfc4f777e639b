"""`rlax-ps export`: a checkpoint of a run, the latest or an earlier one, as the Hugging Face
checkpoint the trainer's own export writes (same files, the weights of that step bit for bit in
export.dtype), read on one device from a run trained on a 2x2 mesh while the run holds its
workdir; a step not saved and an --out holding other files are refused, naming the flag."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from child_env import child_env
from rlax_ps import config_files
from rlax_ps.models import ModelConfig, load_hf_checkpoint
from rlax_ps.models.params import flatten_params
from rlax_ps.train import export_main
from rlax_ps.train.export_main import export_checkpoint
from rlax_ps.train.publisher import flat_params
from rlax_ps.train.run import EXPORT_RECORD
from rlax_ps.train.sft import SFTTrainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**model):
  """configs/sft_tiny.py:tiny for 4 steps, checkpointed at 2 and 4, exported in bfloat16, on
  a mesh of 2 fsdp x 2 tensor."""
  config = config_files.load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")
  config.train.steps, config.checkpoint.every_steps = 4, 2
  config.export.dtype = "bfloat16"
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 2, 2
  for k, v in model.items():
    config.model[k] = v
  return config


def _host(params):
  return {k: np.asarray(v) for k, v in flat_params(jax.device_get(params)).items()}


def _trained(workdir, config):
  """Train `config` in `workdir` on 4 devices; the trainer's exports (step 2 in exports/,
  step 4 in hf/), its params at both steps, and `rlax-ps export`'s of step 2 made while the
  trainer held the workdir."""
  with SFTTrainer(config, workdir, devices=jax.devices()[:4]) as trainer:
    trainer.train(until=2, progress=False)
    trainer.save()
    trainer.checkpointer.wait()
    params = {2: _host(trainer.state.params)}
    layout = {(len(x.sharding.device_set), str(x.sharding.spec))
              for x in jax.tree.leaves(trainer.state.params)}
    exports = {2: trainer.export_hf(os.path.join(workdir, "exports", "step_2"))}
    during = export_checkpoint(workdir, peft=bool(config.model.get("lora_rank", 0)))
    trainer.train(progress=False)
    trainer.checkpointer.wait()
    params[4] = _host(trainer.state.params)
    exports[4] = trainer.export_hf()
  return dict(workdir=workdir, params=params, exports=exports, during=during, layout=layout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return _trained(str(tmp_path_factory.mktemp("sft")), _config())


def _files(folder):
  return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
          for d, _, names in os.walk(folder) for f in names}


def _same_as_the_trainers(path, trainers, step, checkpoints):
  ours, theirs = _files(path), _files(trainers)
  assert json.loads(ours.pop(EXPORT_RECORD)) == {"checkpoints": checkpoints, "step": step}
  assert set(ours) == set(theirs)
  for name in theirs:
    assert ours[name] == theirs[name], name


def test_the_latest_step_is_exported_as_the_trainer_exported_it(run, tmp_path):
  step, path = export_checkpoint(run["workdir"], out=str(tmp_path / "latest"))
  assert (step, path) == (4, str(tmp_path / "latest"))
  _same_as_the_trainers(path, run["exports"][4], 4, os.path.join(run["workdir"], "checkpoints"))


def test_an_earlier_step_holds_its_weights_bit_for_bit_in_the_export_dtype(run, tmp_path):
  step, path = export_checkpoint(run["workdir"], step=2, out=str(tmp_path / "two"))
  assert step == 2
  _same_as_the_trainers(path, run["exports"][2], 2, os.path.join(run["workdir"], "checkpoints"))
  got = flatten_params(load_hf_checkpoint(path, "bfloat16"))
  want = run["params"][2]
  assert set(got) == set(want) and not all(
      np.array_equal(want[k], run["params"][4][k]) for k in want)  # step 2's, not step 4's
  for name, value in want.items():
    np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint16),
                                  value.astype(jax.numpy.bfloat16).view(np.uint16), err_msg=name)


def test_any_step_is_exported_in_fp8_on_request(run, tmp_path):
  step, path = export_checkpoint(run["workdir"], step=2, out=str(tmp_path / "fp8"),
                                 quantization="fp8")
  written = json.load(open(os.path.join(path, "config.json")))
  assert step == 2 and written["quantization_config"]["quant_method"] == "fp8"
  got = flatten_params(load_hf_checkpoint(path))  # dequantized: near step 2's weights
  q = "layers.0.attn.q_proj.kernel"
  err = np.abs(np.asarray(got[q]) - run["params"][2][q])
  assert 0 < err.max() <= np.abs(run["params"][2][q]).max() / 16
  with pytest.raises(ValueError, match=r"--quantization: expected one of \('', 'fp8', "
                                       r"'fp8_ue8m0', 'mxfp4'\)"):
    export_checkpoint(run["workdir"], out=str(tmp_path / "x"), quantization="int4")
  with pytest.raises(ValueError, match="--quantization: 'mxfp4' writes gpt-oss's experts"):
    export_checkpoint(run["workdir"], out=str(tmp_path / "x"), quantization="mxfp4")
  assert not os.path.exists(tmp_path / "x")


def test_a_run_holding_its_workdir_is_exported_and_trains_on(run):
  # Made while the trainer held the workdir, at step 2: no lock taken, nothing else written.
  assert run["during"] == (2, os.path.join(run["workdir"], "hf-step-2"))
  _same_as_the_trainers(run["during"][1], run["exports"][2], 2,
                        os.path.join(run["workdir"], "checkpoints"))
  assert sorted(os.listdir(os.path.join(run["workdir"], "checkpoints"))) == ["2", "4"]


def test_a_save_in_progress_and_the_checkpoints_are_left_as_they_are(run, tmp_path):
  checkpoints = os.path.join(run["workdir"], "checkpoints")
  saving = os.path.join(checkpoints, "6.orbax-checkpoint-tmp-1")  # a trainer's save under way
  os.makedirs(os.path.join(saving, "state"))
  with open(os.path.join(saving, "state", "written_so_far"), "wb") as f:
    f.write(b"\0" * 8)
  try:
    before = _files(checkpoints)
    assert export_checkpoint(run["workdir"], out=str(tmp_path / "x"))[0] == 4
    assert _files(checkpoints) == before
  finally:
    shutil.rmtree(saving)


def test_a_run_trained_on_a_2x2_mesh_is_read_on_one_device(run):
  assert {n for n, _ in run["layout"]} == {4}  # the run's params lay on 4 devices, split
  assert {str(P("fsdp", "tensor")), str(P("tensor", "fsdp"))} <= {s for _, s in run["layout"]}
  with export_main.open_reader(run["workdir"]) as reader:
    model_config = ModelConfig.from_dict(reader.metadata(4)["model_config"])
    _, params = export_main.checkpoint_params(reader, 4, model_config, jax.devices()[0])
  assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(params))
  got = _host(params)
  assert set(got) == set(run["params"][4])
  for name, value in got.items():
    np.testing.assert_array_equal(value, run["params"][4][name], err_msg=name)


@pytest.mark.parametrize("given", [None, 4])
def test_a_step_the_running_trainer_deletes_while_it_is_read(run, tmp_path, monkeypatch, given):
  """A running trainer deletes its old steps (checkpoint.max_to_keep) as it saves: the latest
  step read meanwhile was named damaged ("delete it to start anew"). The export takes the
  new latest; a step given by --step is named as deleted by the trainer."""
  workdir = str(tmp_path / "run")
  shutil.copytree(run["workdir"], workdir)
  read = export_main.checkpoint_params

  def deleted_while_read(reader, step, *args):
    if step == 4:  # (the trainer's retention, as if it had saved a step 6 and kept one)
      shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
    return read(reader, step, *args)

  monkeypatch.setattr(export_main, "checkpoint_params", deleted_while_read)
  if given is None:
    assert export_checkpoint(workdir, out=str(tmp_path / "x"))[0] == 2
    _same_as_the_trainers(str(tmp_path / "x"), run["exports"][2], 2,
                          os.path.join(workdir, "checkpoints"))
  else:
    with pytest.raises(ValueError, match=r"^--step: step 4 was deleted while it was read: the "
                                         r"run's trainer keeps .*; saved now: 2$"):
      export_checkpoint(workdir, step=given, out=str(tmp_path / "x"))


def test_a_step_not_saved_is_named_with_the_saved_ones(run, tmp_path):
  with pytest.raises(ValueError, match=r"^--step: 3 is not saved in .*checkpoints; saved steps: "
                                       r"2, 4$"):
    export_checkpoint(run["workdir"], step=3, out=str(tmp_path / "x"))
  assert not os.path.exists(tmp_path / "x")


def test_an_out_folder_holding_other_files_is_refused_and_kept(run, tmp_path):
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep")
  with pytest.raises(ValueError, match=r"^--out: .*mine is not empty \(notes.txt\) and holds no "
                                       r"export of `rlax-ps export`"):
    export_checkpoint(run["workdir"], out=str(mine))
  assert os.listdir(mine) == ["notes.txt"]
  # An earlier export of another step is refused too; one of the same step is replaced.
  earlier = os.path.join(run["workdir"], "hf-step-2")
  with pytest.raises(ValueError, match=r"^--out: .*hf-step-2 holds the export of step 2 of "):
    export_checkpoint(run["workdir"], step=4, out=earlier)
  assert export_checkpoint(run["workdir"], step=2) == (2, earlier)


def test_an_export_a_kill_left_aside_is_put_back_before_the_next_is_written(run, tmp_path,
                                                                           monkeypatch):
  """A kill between an export's two renames leaves the one before at <out>.old and nothing
  at <out>: the next export puts it back first, so a failure of that one (here its
  weights cannot be written) still leaves a whole export at <out>."""
  from rlax_ps.train import run as run_lib
  out = str(tmp_path / "model")
  assert export_checkpoint(run["workdir"], step=2, out=out)[0] == 2
  os.rename(out, out + ".old")  # as a kill between the renames leaves it

  def disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(run_lib, "save_hf_checkpoint", disk_full)
  with pytest.raises((OSError, ValueError), match="No space left"):
    export_checkpoint(run["workdir"], step=2, out=out)
  with open(os.path.join(out, EXPORT_RECORD)) as f:
    assert json.load(f)["step"] == 2
  assert not os.path.exists(out + ".old")


@pytest.mark.parametrize("suffix", [".old", ".partial"])
def test_a_folder_beside_out_that_an_export_would_delete_is_refused_and_kept(run, tmp_path,
                                                                            suffix):
  """An export writes <out>.partial and moves an earlier export to <out>.old, deleting both
  after: a folder of that name holding other files is refused, not deleted; a partial
  export a kill left is this command's (its record is written first) and is replaced."""
  beside = tmp_path / f"model{suffix}"
  beside.mkdir()
  (beside / "keep").write_text("mine")
  with pytest.raises(ValueError, match=rf"^--out: .*model\{suffix} holds no export of "):
    export_checkpoint(run["workdir"], step=2, out=str(tmp_path / "model"))
  assert os.listdir(beside) == ["keep"]
  (beside / "keep").unlink()
  (beside / "rlax_ps_export.json").write_text("{}")  # an export's, as a kill left it
  assert export_checkpoint(run["workdir"], step=2, out=str(tmp_path / "model"))[0] == 2
  assert not beside.exists() and (tmp_path / "model" / "rlax_ps_export.json").exists()


def test_peft_on_a_run_without_adapters_names_the_flag(run, tmp_path):
  with pytest.raises(ValueError, match=r"^--peft: the run's model has no adapters PEFT can "
                                       r"hold \(model.lora_rank: expected > 0"):
    export_checkpoint(run["workdir"], out=str(tmp_path / "x"), peft=True)


def test_a_folder_without_checkpoints_names_workdir(tmp_path):
  with pytest.raises(ValueError, match=r"^--workdir: no checkpoints in .*; expected the "
                                       r"--workdir of `rlax-ps train`, `rlax-ps sft` or "):
    export_checkpoint(str(tmp_path))
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(ValueError, match=r"^--workdir: no complete checkpoint in "):
    export_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match=r"^--workdir: .*absent is not a folder$"):
    export_checkpoint(str(tmp_path / "absent"))


def _record_paths_inside(workdir, checkpoints, warm_start):
  """Make `workdir` (a copy of the run) record what a run of `rlax-ps local` does: its
  run_config.json names `checkpoints`, and its checkpoints' configs a warm start
  (init_from_hf) `warm_start`, both inside the folder."""
  with open(os.path.join(workdir, config_files.RUN_CONFIG), "w") as f:
    json.dump({"checkpoint": {"directory": checkpoints}}, f)
  for step in ("2", "4"):
    path = os.path.join(workdir, "checkpoints", step, "metadata", "metadata")
    with open(path) as f:
      saved = json.load(f)
    saved["config"]["init_from_hf"] = warm_start
    with open(path, "w") as f:
      json.dump(saved, f)


def test_a_moved_run_is_exported_from_where_it_lies_now(run, tmp_path):
  old, new = str(tmp_path / "old"), str(tmp_path / "elsewhere" / "renamed")
  shutil.copytree(run["workdir"], old)
  _record_paths_inside(old, os.path.join(old, "checkpoints"),
                       os.path.join(old, "exports", "step_2"))
  shutil.move(old, new)
  assert not os.path.exists(old)
  step, path = export_checkpoint(new, out=str(tmp_path / "out"))
  assert step == 4
  _same_as_the_trainers(path, run["exports"][4], 4, os.path.join(new, "checkpoints"))


def test_a_moved_local_runs_paths_resolve_to_their_own_places_longest_tail_first(tmp_path):
  """A moved (not copied) `rlax-ps local` workdir holds sft/hf (the warm start) and hf (the RL
  run's own export): the warm start recorded as <old>/sft/hf is <new>/sft/hf, the longest
  tail first (the shortest named the trained policy as a --peft adapter's base), and the
  chat template that lay in the run folder is found there too."""
  import ml_collections
  new = tmp_path / "renamed"
  for folder in ("sft/hf", "hf", "templates"):
    (new / folder).mkdir(parents=True)
  (new / "templates" / "chat.jinja").write_text("{{ messages }}")
  old = "/gone/old_run"
  assert export_main.moved_path("init_from_hf", f"{old}/sft/hf", str(new)) == str(new / "sft/hf")
  config = ml_collections.ConfigDict({"init_from_hf": f"{old}/sft/hf", "tokenizer": {
      "path": "", "chat_template": f"{old}/templates/chat.jinja"}})
  moved = export_main.moved_config(config, str(new))
  assert moved.tokenizer.chat_template == str(new / "templates" / "chat.jinja")
  assert moved.init_from_hf == str(new / "sft/hf")


def test_an_out_folder_holding_another_runs_export_of_the_same_step_is_refused(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / EXPORT_RECORD).write_text(json.dumps({"checkpoints": "/runs/other/checkpoints",
                                               "step": 3}))
  (out / "model.safetensors").write_text("the other run's weights")
  with pytest.raises(ValueError, match=r"^--out: .*out holds the export of step 3 of "):
    export_main.check_out(str(out), {"checkpoints": "/runs/this/checkpoints", "step": 3})
  export_main.check_out(str(out), {"checkpoints": "/runs/other/checkpoints", "step": 3})
  assert (out / "model.safetensors").read_text() == "the other run's weights"


def test_quantization_given_as_empty_exports_unquantized_a_run_that_asked_for_fp8(
    run, tmp_path, monkeypatch):
  from rlax_ps.train import run as run_lib
  options = run_lib.export_options
  monkeypatch.setattr(run_lib, "export_options",
                      lambda config: {**options(config), "quantization": "fp8"})
  _, path = export_checkpoint(run["workdir"], step=2, out=str(tmp_path / "fp8"))
  assert "quantization_config" in json.load(open(os.path.join(path, "config.json")))
  _, path = export_checkpoint(run["workdir"], step=2, out=str(tmp_path / "plain"),
                              quantization="")
  assert "quantization_config" not in json.load(open(os.path.join(path, "config.json")))
  got = flatten_params(load_hf_checkpoint(path))
  q = "layers.0.attn.q_proj.kernel"  # step 2's weights in export.dtype (bf16)
  np.testing.assert_array_equal(np.asarray(got[q], np.float32),
                                run["params"][2][q].astype(jax.numpy.bfloat16).astype(np.float32))


def test_a_recorded_path_outside_the_run_is_used_and_named_when_gone(run, tmp_path):
  outside = str(tmp_path / "outside")
  os.makedirs(outside)
  with open(os.path.join(outside, config_files.RUN_CONFIG), "w") as f:
    json.dump({"checkpoint": {"directory": os.path.join(run["workdir"], "checkpoints")}}, f)
  assert export_main.checkpoints_of(outside) == os.path.join(run["workdir"], "checkpoints")
  gone = str(tmp_path / "gone" / "checkpoints")
  with open(os.path.join(outside, config_files.RUN_CONFIG), "w") as f:
    json.dump({"checkpoint": {"directory": gone}}, f)
  with pytest.raises(ValueError, match=rf"^checkpoint.directory: {gone}, as the run recorded "
                                       rf"it, is not found, nor at its place in --workdir "):
    export_checkpoint(outside)


def _command(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", "export", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120, env=child_env())


def test_the_command_refuses_a_step_not_saved_in_one_line(run, tmp_path):
  refused = _command(f"--workdir={run['workdir']}", "--step=3", f"--out={tmp_path / 'x'}")
  assert refused.returncode == 2
  assert refused.stderr.strip().splitlines() == [
      f"rlax-ps export: --step: 3 is not saved in {run['workdir']}/checkpoints; saved steps: 2, 4"]


@pytest.mark.slow
def test_the_command_writes_the_export_and_names_it(run, tmp_path):
  done = _command(f"--workdir={run['workdir']}", "--step=2", f"--out={tmp_path / 'cli'}")
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == f"Hugging Face export of step 2: {tmp_path / 'cli'}"
  _same_as_the_trainers(str(tmp_path / "cli"), run["exports"][2], 2,
                        os.path.join(run["workdir"], "checkpoints"))


@pytest.mark.slow
def test_a_lora_run_exports_merged_and_with_peft_its_adapter_as_the_trainer(tmp_path):
  lora = _trained(str(tmp_path / "lora"), _config(lora_rank=4, lora_alpha=8.0,
                                                  lora_targets="q_proj,v_proj"))
  _same_as_the_trainers(lora["during"][1], lora["exports"][2], 2,
                        os.path.join(lora["workdir"], "checkpoints"))
  assert os.path.isfile(os.path.join(lora["during"][1], "adapter", "adapter_model.safetensors"))
  _, merged = export_checkpoint(lora["workdir"], out=str(tmp_path / "merged"))
  assert "adapter" not in os.listdir(merged)
  trainers = _files(lora["exports"][4])
  assert {k: v for k, v in _files(merged).items() if k != EXPORT_RECORD} == {
      k: v for k, v in trainers.items() if not k.startswith("adapter")}


def test_an_export_replacing_another_moves_it_aside_before_deleting_it(tmp_path, monkeypatch):
  """A kill while the replaced export is deleted (seconds for a large model) leaves the new
  export whole at its path: the old one is renamed aside first (it was deleted in place,
  the new one still under .partial)."""
  from flax import nnx

  from rlax_ps.models import Transformer
  from rlax_ps.tokenizers import CharTokenizer
  from rlax_ps.train import run as run_lib
  tok = CharTokenizer()
  config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
  path = str(tmp_path / "hf")
  run_lib.write_hf_export(graphdef, params, tok, path)
  params2 = jax.tree.map(lambda x: x + 1, params)
  real = shutil.rmtree

  def killed_deleting(p, *args, **kwargs):  # the kill comes while an export is deleted
    if os.path.exists(os.path.join(p, "config.json")):
      raise KeyboardInterrupt
    return real(p, *args, **kwargs)

  monkeypatch.setattr(run_lib.shutil, "rmtree", killed_deleting)
  with pytest.raises(KeyboardInterrupt):
    run_lib.write_hf_export(graphdef, params2, tok, path)
  loaded = flatten_params(nnx.state(load_hf_checkpoint(path), nnx.Param))
  want = flatten_params(params2)
  for name, value in want.items():  # the new export, whole
    np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(value), name)
  monkeypatch.setattr(run_lib.shutil, "rmtree", real)
  run_lib.write_hf_export(graphdef, params, tok, path)  # the next one tidies what was left
  assert sorted(os.listdir(tmp_path)) == ["hf"]
