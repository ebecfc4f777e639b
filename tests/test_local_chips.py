"""`rlax-ps local`'s split of one host's GPUs or TPU chips (rlax_ps/chips.py), on fake device
folders: no JAX, no accelerator."""

import pytest

from rlax_ps import chips


def fake_dev(tmp_path, *files):
  """A /dev with these device files (and the folders and non-chip files a real one has)."""
  dev = tmp_path / "dev"
  (dev / "vfio").mkdir(parents=True)
  for f in ("vfio/vfio", "nvidiactl", "nvidia-uvm", "accel", *files):
    (dev / f).touch()
  return str(dev)


def v5e_8(tmp_path):
  return fake_dev(tmp_path, *(f"vfio/{i}" for i in range(8)))


def v4_8(tmp_path):
  return fake_dev(tmp_path, *(f"accel{i}" for i in range(4)))


def tpu_env(chips_, port):
  return {"TPU_VISIBLE_CHIPS": chips_, "TPU_PROCESS_BOUNDS": "1,1,1",
          "TPU_CHIPS_PER_PROCESS_BOUNDS": {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}[
              len(chips_.split(","))],
          "TPU_PROCESS_PORT": str(port), "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
          "CLOUD_TPU_TASK_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def ports(envs):
  return [int(env["TPU_PROCESS_PORT"]) for env in envs]


def test_the_host_kind_and_chip_count_come_from_the_device_files(tmp_path):
  assert chips.detect_host(v5e_8(tmp_path)) == chips.Host("tpu", 8)
  assert chips.detect_host(fake_dev(tmp_path / "a", "nvidia0", "nvidia1")) == chips.Host("gpu", 2)
  assert chips.detect_host(fake_dev(tmp_path / "b")) == chips.Host("", 0)


def test_a_v5e_8_gives_the_trainer_4_chips_and_two_workers_2_each(tmp_path):
  envs = chips.split_envs(4, 2, 2, v5e_8(tmp_path), env={})
  assert len(set(ports(envs))) == 3  # a port of its own each
  assert envs == [tpu_env("0,1,2,3", ports(envs)[0]), tpu_env("4,5", ports(envs)[1]),
                  tpu_env("6,7", ports(envs)[2])]
  assert "JAX_PLATFORMS" not in envs[1]


def test_a_v4_8_gives_the_trainer_2_chips_and_two_workers_1_each(tmp_path):
  envs = chips.split_envs(2, 1, 2, v4_8(tmp_path), env={})
  assert envs == [tpu_env("0,1", ports(envs)[0]), tpu_env("2", ports(envs)[1]),
                  tpu_env("3", ports(envs)[2])]
  assert len(set(ports(envs))) == 3


def test_a_process_with_all_the_hosts_chips_keeps_libtpus_defaults():
  assert chips.tpu_env(range(8), 8, 1234) == {}
  assert chips.tpu_env(range(4, 8), 8, 1234) == tpu_env("4,5,6,7", 1234)


def test_a_gpu_host_gets_cuda_visible_devices_of_any_count(tmp_path):
  dev = fake_dev(tmp_path, *(f"nvidia{i}" for i in range(8)))
  assert chips.split_envs(3, 2, 2, dev, env={}) == [
      {"CUDA_VISIBLE_DEVICES": "0,1,2"}, {"CUDA_VISIBLE_DEVICES": "3,4"},
      {"CUDA_VISIBLE_DEVICES": "5,6"}]


def test_the_gpus_this_process_was_given_are_the_ones_split(tmp_path):
  """On a shared host (CUDA_VISIBLE_DEVICES=4,5,6,7, or a scheduler's list) the split was
  of GPUs 0.. (other users'), checked against all 8."""
  dev = fake_dev(tmp_path, *(f"nvidia{i}" for i in range(8)))
  given = {"CUDA_VISIBLE_DEVICES": "4,5,6,GPU-7a"}
  assert chips.split_envs(2, 1, 2, dev, env=given) == [
      {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6"},
      {"CUDA_VISIBLE_DEVICES": "GPU-7a"}]
  with pytest.raises(ValueError, match="= 5 chips, more than this host's 4 GPU chips"):
    chips.split_envs(3, 1, 2, dev, env=given)
  with pytest.raises(ValueError, match=r"given chips 0,1 alone \(TPU_VISIBLE_CHIPS\)"):
    chips.split_envs(2, 1, 2, v5e_8(tmp_path / "t"), env={"TPU_VISIBLE_CHIPS": "0,1"})


@pytest.mark.parametrize("host, split, message", [
    (v5e_8, (1, 2, 2), "worker-0's 2 chips would start at chip 1, not a multiple of 2"),
    (v4_8, (2, 1, 3), "2 + 3 workers (local.workers) x 1 = 5 chips, more than this host's 4 TPU"),
    (v5e_8, (3, 1, 2), "a TPU process takes 1, 2 or 4 chips"),
    (v5e_8, (8, 1, 1), "a TPU process takes 1, 2 or 4 chips (the whole host is the trainer's"),
    (lambda tmp_path: fake_dev(tmp_path, "nvidia0", "nvidia1"), (2, 1, 1),
     "= 3 chips, more than this host's 2 GPU chips"),
    (fake_dev, (1, 1, 1), "but no GPU or TPU chip was found"),
])
def test_a_split_that_does_not_fit_the_host_is_refused_naming_the_fields(host, split, message,
                                                                         tmp_path):
  with pytest.raises(ValueError, match="local.trainer_chips, local.chips_per_worker: ") as e:
    chips.split_envs(*split, host(tmp_path), env={})
  assert message in str(e.value)
