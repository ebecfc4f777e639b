"""Fixtures for parameter-server tests: servers on 127.0.0.1 (free ports) stopped by the test, clients."""

import pytest

from param_server.server import ParamServer
from ps_testlib import client_for, small_config, spawn_server


@pytest.fixture
def start_server(tmp_path):
  """start_server(**config overrides) -> a started ParamServer, stopped after the test."""
  servers = []

  def start(**overrides):
    overrides.setdefault("storage_dir", tmp_path / "ps")
    server = ParamServer(small_config(**overrides)).start()
    servers.append(server)
    return server

  yield start
  for s in servers:
    s.stop(grace=0)


@pytest.fixture
def server(start_server):
  return start_server()


@pytest.fixture
def trainer(server):
  with client_for(server, "trainer") as c:
    yield c


@pytest.fixture
def worker(server):
  with client_for(server, "worker") as c:
    c.register("test-worker")
    yield c


@pytest.fixture
def viewer(server):
  with client_for(server, "viewer") as c:
    yield c


@pytest.fixture
def server_process():
  """spawn(storage_dir, *flags) -> (proc, address); every process is killed after the test."""
  procs = []

  def spawn(storage_dir, *flags):
    proc, address = spawn_server(storage_dir, *flags)
    procs.append(proc)
    return proc, address

  yield spawn
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
    p.stdout.close()
