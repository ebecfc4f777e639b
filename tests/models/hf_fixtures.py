"""The committed tiny HF checkpoints (tests/fixtures/hf) and the jitted calls the model tests
share, so each program compiles once per process."""

import functools
import json
import os

import numpy as np
from flax import nnx

from rlax_ps.models import load_hf_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")


def reference(name):
  """(tokens [2, T], transformers' float32 logits [2, T, V]) of fixture `name`."""
  ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
  return ref["tokens"], ref["logits"]


def fixture_config(name, file="config.json"):
  """Fixture `name`'s config.json (or its other-layout copy `file`), parsed."""
  with open(os.path.join(FIXTURES, name, file)) as f:
    return json.load(f)


@functools.cache
def fixture_model(name):
  """Fixture `name` loaded in float32 (once per process)."""
  return load_hf_checkpoint(os.path.join(FIXTURES, name), dtype="float32")


@nnx.jit
def forward(model, tokens, positions=None, segment_ids=None):
  return model(tokens, positions=positions, segment_ids=segment_ids)


@nnx.jit
def decode(model, tokens, cache):
  return model(tokens, cache=cache)
