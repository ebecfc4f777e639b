"""Checkpoints: a run killed (SIGKILL) between saves resumes from its last complete one
with the same step, RNG, params and data position; restores land on another mesh."""

import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from child_env import child_env
from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.checkpoint import Checkpointer
from rlax_ps.folder_lock import FolderInUse
from rlax_ps.models import ModelConfig
from rlax_ps.train.sft import SFTTrainer
from rlax_ps.train.state import TrainState, abstract_state, restore_or_init, sharded_init

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = {"train.steps": 100000, "checkpoint.every_steps": 3, "checkpoint.max_to_keep": 2,
             "export.hf": False}


def _config():
  spec = importlib.util.spec_from_file_location("sft_tiny", os.path.join(REPO, "configs",
                                                                          "sft_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("tiny")
  for key, value in OVERRIDES.items():
    block, field = key.split(".")
    config[block][field] = value
  return config


def _assert_same_tree(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7,
                               err_msg=jax.tree_util.keystr(path))


def _complete_steps(directory):
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


@pytest.mark.slow  # suite time: the RL trainer's kill-and-resume test stays in the default suite
def test_killed_run_resumes_from_last_complete_checkpoint(tmp_path):
  workdir = str(tmp_path / "killed")
  # The same 8 fake devices and compile cache as this process: its compiles are reused here.
  env = dict(os.environ)
  cmd = [sys.executable, "-m", "rlax_ps", "sft", "--config=configs/sft_tiny.py:tiny",
         "--workdir=" + workdir, "--noprogress"]
  cmd += [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  deadline = time.time() + 300
  try:
    while len(_complete_steps(ckpt_dir)) < 2:
      assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
      assert time.time() < deadline, "no two checkpoints within 300s"
      time.sleep(0.05)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL

  config = _config()
  with SFTTrainer(config, workdir) as resumed:
    k = resumed.step
    assert k > 0 and k % 3 == 0
    assert k == _complete_steps(ckpt_dir)[-1]
    meta = resumed.checkpointer.metadata(k)
    assert meta["step"] == k and meta["data"]["position"] == k
    with SFTTrainer(config, str(tmp_path / "reference")) as reference:
      reference.train(until=k, progress=False)
      assert reference.step == k
      _assert_same_tree(resumed.state.params, reference.state.params)
      _assert_same_tree(resumed.state.opt_state, reference.state.opt_state)
      np.testing.assert_array_equal(np.asarray(resumed.state.rng),
                                    np.asarray(reference.state.rng))
      # Continuing both gives the same run: same data position, same updates.
      resumed.train(until=k + 2, progress=False)
      reference.train(until=k + 2, progress=False)
      assert resumed.step == reference.step == k + 2
      _assert_same_tree(resumed.state.params, reference.state.params)
      np.testing.assert_array_equal(np.asarray(resumed.state.rng),
                                    np.asarray(reference.state.rng))


def test_a_run_on_records_resumes_at_its_place_in_them(tmp_path):
  """data.jsonl's records: the checkpoint keeps the stream's position (and the records the
  last batch left over), so a resumed run's next batch is the one the first would have
  drawn, and no record is skipped or seen twice in the epoch."""
  import json
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                          for i in range(20)))
  config = _config()
  config.data.jsonl = str(path)
  workdir = str(tmp_path / "sft")
  with SFTTrainer(config, workdir) as first:
    first.train(until=3, progress=False)
    first.save()
    first.checkpointer.wait()
    assert first.checkpointer.latest_step() == 3
    state = first.data.state()
    following = first.data.batch(3)["tokens"]
  assert state["position"] > 0
  with SFTTrainer(config, workdir) as again:
    assert again.step == 3 and again.data.state() == state
    np.testing.assert_array_equal(again.data.batch(3)["tokens"], following)


MODEL = ModelConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)
OPT = {"lr": 1e-2, "warmup_steps": 0, "eps": 1e-4, "clip_norm": 0.5, "weight_decay": 0.1}


def _mesh(axes):
  return shd.make_mesh(dict(zip(shd.MESH_AXES, axes)), jax.devices()[:int(np.prod(axes))])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A checkpoint written from a (2, 2, 2) mesh, and the host copy of what it holds."""
  directory = str(tmp_path_factory.mktemp("ckpt"))
  tx = optim.make_optimizer(OPT, total_steps=10)
  state, _, _ = sharded_init(MODEL, tx, _mesh((2, 2, 2)), seed=0)
  state = state.replace(step=state.step + 7, rng=jax.random.fold_in(state.rng, 3))
  with Checkpointer(directory) as ck:
    ck.save(7, state.to_tree(), {"note": "from (2,2,2)", "data": {"position": 7}})
  return directory, tx, jax.device_get(state)


@pytest.mark.parametrize("axes", [(1, 2, 4), (8, 1, 1), (1, 1, 1)])
def test_restore_onto_another_mesh(saved, axes):
  directory, tx, host = saved
  mesh = _mesh(axes)
  target = abstract_state(MODEL, tx, mesh)
  with Checkpointer(directory) as ck:
    tree, meta = ck.restore(target.to_tree())
  restored = TrainState.from_tree(tree)
  assert meta == {"note": "from (2,2,2)", "data": {"position": 7}}
  assert int(restored.step) == 7
  _assert_same_tree(restored, host)
  assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(lambda x: x.sharding,
                                                                      target)


def test_keeps_only_the_last_n(tmp_path):
  tree = {"w": np.arange(4.0, dtype=np.float32)}
  with Checkpointer(str(tmp_path), max_to_keep=2) as ck:
    for step in (1, 2, 3, 4):
      ck.save(step, {"w": tree["w"] + step}, {"step": step})
    ck.wait()
    assert ck.all_steps() == [3, 4]
    restored, meta = ck.restore({"w": jax.ShapeDtypeStruct((4,), np.float32)})
  assert meta == {"step": 4}
  np.testing.assert_array_equal(np.asarray(restored["w"]), tree["w"] + 4)


def test_a_step_a_newer_release_wrote_is_refused_in_a_line_and_left_as_it_is(tmp_path,
                                                                             monkeypatch):
  """A rollback to an older rlax-ps over a newer one's workdir: that release's fields would
  fail to load, or load wrong (a data order it does not know), so the format stamp says so."""
  from rlax_ps import checkpoint
  with Checkpointer(str(tmp_path), async_save=False) as ck:
    ck.save(1, {"w": np.zeros(4, np.float32)}, {"step": 1})
    assert ck.metadata(1) == {"step": 1}  # the stamp is the checkpoint's, not the caller's
  monkeypatch.setattr(checkpoint, "FORMAT", checkpoint.FORMAT + 1)  # the newer release
  with Checkpointer(str(tmp_path), async_save=False) as ck:
    ck.save(2, {"w": np.ones(4, np.float32)}, {"step": 2})
  monkeypatch.undo()
  files = sorted(str(p) for p in tmp_path.rglob("*"))
  with Checkpointer(str(tmp_path)) as ck:
    newer = rf"step 2 in {tmp_path} was written by a newer rlax-ps \(checkpoint format "
    with pytest.raises(ValueError, match=newer):
      ck.restore({"w": jax.ShapeDtypeStruct((4,), np.float32)})
    with pytest.raises(ValueError, match=newer):
      ck.metadata(2)
    restored, meta = ck.restore({"w": jax.ShapeDtypeStruct((4,), np.float32)}, step=1)
  assert meta == {"step": 1} and sorted(str(p) for p in tmp_path.rglob("*")) == files


def test_an_async_save_writes_the_metadata_as_it_was_when_saved(tmp_path):
  """The caller goes on changing what its metadata holds (a held-out round's scores) while
  an async save writes it from a thread: the checkpoint has the values of the save."""
  scores = {"addition": [1.0]}
  with Checkpointer(str(tmp_path), async_save=True) as ck:
    ck.save(1, {"w": np.zeros(4, np.float32)}, {"scores": scores})
    scores["addition"].extend([0.0] * 3)
    ck.wait()
    assert ck.metadata(1) == {"scores": {"addition": [1.0]}}


def test_close_awaits_the_cleanup_of_unfinished_saves_before_an_exit(tmp_path):
  """Unfinished saves' tmp folders, which orbax removes in a thread as a Checkpointer opens, are
  gone once close() returns, and a process that exits at once prints no error about it."""
  for step in range(20):
    os.makedirs(tmp_path / f"{step}.orbax-checkpoint-tmp-{step}" / "state")
  (tmp_path / "7").mkdir()  # not a save's tmp folder: kept
  opens_and_exits = ("import os, sys; from rlax_ps.checkpoint import Checkpointer; "
                     "Checkpointer(sys.argv[1]).close(); print(sorted(os.listdir(sys.argv[1])))")
  child = subprocess.run([sys.executable, "-c", opens_and_exits, str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=child_env())
  assert child.returncode == 0, child.stderr
  assert child.stdout.split() == ["['7']"]
  assert "cannot schedule new futures" not in child.stderr, child.stderr
  assert sorted(os.listdir(tmp_path)) == ["7"]


def test_restore_without_checkpoint_names_the_directory(tmp_path):
  with Checkpointer(str(tmp_path / "empty")) as ck:
    assert ck.latest_step() is None
    with pytest.raises(FileNotFoundError, match="empty"):
      ck.restore({"w": jax.ShapeDtypeStruct((4,), np.float32)})


def test_unwritable_directory_is_refused_before_any_step(tmp_path):
  """A checkpoint directory the run cannot write (here a file; read-only or not permitted
  alike) is named at once, not at the first save (async: a 5-minute hang, then tracebacks)."""
  path = tmp_path / "a_file"
  path.write_text("")
  with pytest.raises(OSError, match=f"checkpoint.directory: expected a directory this "
                                    f"process can write, got {path}"):
    Checkpointer(str(path))


def test_a_second_trainer_on_a_workdir_in_use_is_refused_naming_the_first(tmp_path):
  """A rerun while the first run still trains (an orphan, another terminal) would interleave
  checkpoints with it: refused. A trainer whose config was refused, or that closed, leaves
  the workdir free."""
  workdir = str(tmp_path / "run")
  for field, value, message in [("optimizer.grad_accum_steps", 3, "a divisor of"),
                                ("data.batch_size", 0, "expected >= 1"),
                                ("model.max_position_embeddings", 8, "data.seq_len: expected "
                                 "at most the model's max_position_embeddings=8")]:
    bad = _config()
    block, key = field.split(".")
    bad[block][key] = value
    with pytest.raises(ValueError, match=message):
      SFTTrainer(bad, workdir)
  with SFTTrainer(_config(), workdir):
    with pytest.raises(FolderInUse, match=f"--workdir {workdir}: held by a trainer in this "
                       f"process that was not closed"):
      SFTTrainer(_config(), workdir)
  with SFTTrainer(_config(), workdir) as again:
    assert again.workdir == workdir


def _two_steps(directory):
  with Checkpointer(directory, async_save=False) as ck:
    for step in (1, 2):
      ck.save(step, {"w": np.full(4, step, np.float32)}, {"step": step})


@pytest.mark.parametrize("damage", ["emptied", "state_deleted", "metadata_deleted",
                                    "data_cut"])
def test_damaged_latest_step_names_the_folder_and_what_deleting_it_resumes(tmp_path, damage):
  """A latest step folder that cannot be read (emptied, an item gone) is named, with the step
  that deleting it resumes from, instead of orbax's KeyError about items."""
  directory = str(tmp_path)
  _two_steps(directory)
  folder = os.path.join(directory, "2")
  if damage == "emptied":
    for name in os.listdir(folder):
      path = os.path.join(folder, name)
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  elif damage == "state_deleted":
    shutil.rmtree(os.path.join(folder, "state"))
  elif damage == "data_cut":  # a step renamed into place before its data reached the disk
    for root, _, files in os.walk(os.path.join(folder, "state")):
      for name in files:
        if os.path.basename(root) == "d":
          with open(os.path.join(root, name), "r+b") as f:
            f.truncate(10)
  else:
    os.remove(os.path.join(folder, "metadata", "metadata"))
  want = f"step 2 in {directory} is incomplete or damaged .*delete {folder} to resume from step 1"
  with Checkpointer(directory) as ck:
    assert ck.latest_step() == 2
    with pytest.raises(ValueError, match=want):
      ck.restore({"w": jax.ShapeDtypeStruct((4,), np.float32)})
  shutil.rmtree(folder)  # as the message says: the step before is restored
  with Checkpointer(directory) as ck:
    tree, meta = ck.restore({"w": jax.ShapeDtypeStruct((4,), np.float32)})
  assert meta == {"step": 1}
  np.testing.assert_array_equal(np.asarray(tree["w"]), np.full(4, 1, np.float32))


def test_a_step_cut_short_read_into_shardings_is_named_in_a_line(tmp_path):
  """Read into shardings (every trainer, `rlax-ps export`), a data file cut in the middle came
  out of orbax as a bare Exception: hundreds of traceback lines, no word of what to delete."""
  directory = str(tmp_path)
  w = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
  with Checkpointer(directory, async_save=False) as ck:
    for step in (1, 2):
      ck.save(step, {"params": {"w": w * step}}, {"step": step})
  for root, _, files in os.walk(os.path.join(directory, "2", "state")):
    for name in files:
      path = os.path.join(root, name)
      if os.path.basename(root) == "d" and os.path.getsize(path) > 1000:
        os.truncate(path, os.path.getsize(path) // 2)
  sharded = jax.ShapeDtypeStruct((128, 128), np.float32,
                                 sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  want = (f"step 2 in {directory} is incomplete or damaged \\(ValueError: OUT_OF_RANGE.*\\); "
          f"delete {os.path.join(directory, '2')} to resume from step 1")
  with Checkpointer(directory) as ck:
    with pytest.raises(ValueError, match=want) as e:
      ck.restore({"params": {"w": sharded}})
    assert "\n" not in str(e.value) and "TensorStore details" not in str(e.value)
  with Checkpointer(directory, read_only=True) as reader:  # `rlax-ps export`'s
    with pytest.raises(ValueError, match=want):
      reader.restore_params({"w": sharded}, 2)
    np.testing.assert_array_equal(np.asarray(reader.restore_params({"w": sharded}, 1)["w"]), w)


def test_state_of_another_layout_is_named_as_such(tmp_path):
  """A restore target laid out otherwise (a changed optimizer) is named as that, without
  orbax's advice to pass partial_restore, an argument no user of the trainers has."""
  directory = str(tmp_path)
  _two_steps(directory)
  target = {"w": jax.ShapeDtypeStruct((4,), np.float32),
            "mu": jax.ShapeDtypeStruct((4,), np.float32)}
  with Checkpointer(directory) as ck:
    with pytest.raises(ValueError, match=f"step 2 in {directory} holds a state laid out "
                                         "otherwise than this config's") as e:
      ck.restore(target)
  assert "partial_restore" not in str(e.value)


def test_changed_model_names_the_changed_fields(tmp_path):
  """Resuming with another model names each changed field with both values, not two dumps
  of every field."""
  tx = optim.make_optimizer(OPT, total_steps=10)
  mesh = _mesh((1, 1, 1))
  state, _, _ = sharded_init(MODEL, tx, mesh, seed=0)
  with Checkpointer(str(tmp_path), async_save=False) as ck:
    ck.save(1, state.to_tree(), {"model_config": MODEL.to_dict()})
  wider = dataclasses.replace(MODEL, hidden_size=64)
  with Checkpointer(str(tmp_path)) as ck:
    with pytest.raises(ValueError, match="model.hidden_size: 32 in the checkpoint, 64 now\\)") \
        as e:
      restore_or_init(wider, tx, mesh, ck)
  assert "rope_theta" not in str(e.value)  # the unchanged fields are not listed


def test_saves_leave_no_objects_behind(tmp_path):
  """orbax's throughput log asked tensorstore for metrics on every array save, whose lists
  tensorstore never frees: a trainer's memory grew with every checkpoint (~24 objects a
  save)."""
  import gc

  import jax.numpy as jnp
  ckpt = Checkpointer(str(tmp_path / "ck"), max_to_keep=2, async_save=False)
  state = {f"w{i}": jnp.full((8, 8), float(i)) for i in range(4)}

  def saves(first, n):
    for step in range(first, first + n):
      ckpt.save(step, state, {"step": step})
    gc.collect()
    return len(gc.get_objects())

  saves(1, 5)  # (caches filled)
  before = saves(6, 5)
  after = saves(11, 40)
  ckpt.close()
  assert after - before < 200, after - before
