"""worker.allocator_args reaches VIGOR's settings (m0, rounds, alpha, gamma); a bad one is
refused at the start naming the field."""

import pytest

from algorithms.allocation import VigorAllocator
from inference_workers.loop import make_allocator
from inference_workers.worker_config import WorkerConfig


def test_vigor_takes_the_settings_given():
  allocator = make_allocator(WorkerConfig(allocator="vigor", allocator_args=(
      '{"m0": 4, "rounds": 3, "alpha": 0.25, "gamma": 1.5}')))
  assert allocator == VigorAllocator(m0=4, rounds=3, alpha=0.25, gamma=1.5)
  assert make_allocator(WorkerConfig(allocator="vigor")) == VigorAllocator()


@pytest.mark.parametrize("allocator, args, message", [
    ("vigor", "{m0: 4}", "expected a JSON object"),
    ("vigor", "[4]", "expected a JSON object"),
    ("vigor", '{"m1": 4}', "expected m0, rounds, alpha, gamma"),
    ("vigor", '{"alpha": 2}', "VigorAllocator.alpha"),
    ("fixed", '{"m0": 4}', "'' with allocator='fixed'"),
])
def test_bad_allocator_args_are_refused_naming_the_field(allocator, args, message):
  with pytest.raises(ValueError, match="WorkerConfig.allocator_args") as e:
    WorkerConfig(allocator=allocator, allocator_args=args)
  assert message in str(e.value)


@pytest.mark.parametrize("samples, args", [(1, ""), (2, '{"m0": 4}')])
def test_vigor_with_fewer_samples_a_prompt_than_its_first_round_is_refused_at_the_start(
    samples, args):
  """It passed every check, then each worker's first lease raised a budget error naming
  neither field."""
  with pytest.raises(ValueError, match=r"WorkerConfig.samples_per_prompt: expected >= "
                                       r"allocator_args' m0="):
    WorkerConfig(allocator="vigor", samples_per_prompt=samples, allocator_args=args)
  WorkerConfig(allocator="vigor", samples_per_prompt=4, allocator_args=args)
