"""Fixtures of the worker-loop tests: two published weight versions of the tiny model and a
parameter server on 127.0.0.1 (stopped after each test)."""

import numpy as np
import pytest
from flax import nnx

from rlax_ps.models import Transformer, flatten_params
from worker_testlib import CONFIG, start_server


@pytest.fixture(scope="module")
def versions():
  v0 = {k: np.asarray(v) for k, v in flatten_params(Transformer(CONFIG, rngs=nnx.Rngs(0))).items()}
  rng = np.random.default_rng(1)
  v1 = {k: (v + (rng.random(v.shape) < 0.02) * 0.01).astype(np.float32) for k, v in v0.items()}
  return [v0, v1]


@pytest.fixture
def server(tmp_path):
  s = start_server(tmp_path / "ps")
  yield s
  s.stop(grace=0)
