"""Settings dataclasses as flags: defaults < config section < explicit flags; clear errors."""

import dataclasses
import os

import pytest
from absl import flags

from inference_workers.worker_config import WorkerConfig
from param_server.server import ServerConfig
from rlax_ps.config_files import load
from rlax_ps.dataclass_flags import define_flags, resolve, setting

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class _Settings:
  name: str = setting("a", "a name")
  count: int = setting(2, "a count")
  rate: float = setting(0.5, "a rate")
  on: bool = setting(False, "a switch")


def _parsed(*argv, cls=_Settings):
  fv = flags.FlagValues()
  define_flags(cls, fv)
  fv(["prog", *argv])
  return fv


def test_flags_override_the_section_which_overrides_the_defaults():
  fv = _parsed("--count=7", "--on")
  got = resolve(_Settings, {"name": "b", "count": 3}, "--config s", fv)
  assert got == _Settings(name="b", count=7, rate=0.5, on=True)
  assert resolve(_Settings, None, "--config s", _parsed()) == _Settings()
  assert "a rate (default 0.5)" in _parsed()["rate"].help


def test_unknown_settings_and_unflaggable_fields_are_named():
  with pytest.raises(ValueError, match=r"--config s: unknown settings \['colour'\]"):
    resolve(_Settings, {"colour": 1}, "--config s", _parsed())

  @dataclasses.dataclass
  class Bad:
    shape: tuple = setting((), "a tuple")

  with pytest.raises(TypeError, match="Bad.shape: a flag needs a str, int, float or bool"):
    define_flags(Bad, flags.FlagValues())


@pytest.mark.parametrize("cls", [ServerConfig, WorkerConfig])
def test_the_server_and_worker_settings_all_become_flags(cls):
  fv = _parsed(cls=cls)
  assert {f.name for f in dataclasses.fields(cls)} <= set(fv)
  assert resolve(cls, None, "x", fv) == cls()


def test_the_server_config_file_holds_every_server_setting():
  fv = _parsed(cls=ServerConfig)
  path = os.path.join(REPO, "configs", "param_server.py")
  assert resolve(ServerConfig, load(path).param_server, "x", fv) == ServerConfig()
  tiny = resolve(ServerConfig, load(path, "tiny").param_server, "x", fv)
  assert tiny.chunk_bytes < ServerConfig().chunk_bytes
