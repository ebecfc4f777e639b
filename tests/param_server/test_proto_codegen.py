"""The committed gRPC code matches what `make protos` generates from the .proto today."""

import filecmp
import os
import shutil

from grpc_tools import protoc

from ps_testlib import REPO

PROTO = "param_server/protos/param_server.proto"
GENERATED = ("param_server_pb2.py", "param_server_pb2.pyi", "param_server_pb2_grpc.py")


def test_generated_code_is_current(tmp_path):
  os.makedirs(tmp_path / "param_server" / "protos")
  shutil.copy(os.path.join(REPO, PROTO), tmp_path / PROTO)
  args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
          f"--grpc_python_out={tmp_path}", str(tmp_path / PROTO)]
  assert protoc.main(args) == 0
  for name in GENERATED:
    fresh = tmp_path / "param_server" / "protos" / name
    assert filecmp.cmp(fresh, os.path.join(REPO, "param_server", "protos", name), shallow=False), (
        f"{name} is stale: run `make protos`")


def test_the_declared_versions_are_the_generated_codes():
  """The test extra pins the generator that wrote the committed code (its version is written
  in it: a newer one's output differs), and the dependencies floor grpcio and protobuf where
  that code's import-time checks do (an older grpcio raises RuntimeError on import)."""
  import re
  import tomllib
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  protos = os.path.join(REPO, "param_server", "protos")
  with open(os.path.join(protos, "param_server_pb2_grpc.py")) as f:
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", f.read())[1]
  with open(os.path.join(protos, "param_server_pb2.py")) as f:
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", f.read())
  major, minor, patch = gencode.groups()
  assert f"grpcio-tools=={grpc_version}" in project["optional-dependencies"]["test"]
  assert f"grpcio>={grpc_version}" in project["dependencies"]
  assert f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}" in project["dependencies"]


def test_servicer_implements_every_rpc_of_the_proto():
  """The generated base class answers UNIMPLEMENTED (NotImplementedError); ours overrides all."""
  from param_server.protos import param_server_pb2 as pb
  from param_server.protos import param_server_pb2_grpc as pb_grpc
  from param_server.server import ParamServerServicer

  rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["ParamServer"].methods]
  assert len(rpcs) >= 15
  not_overridden = [name for name in rpcs if getattr(ParamServerServicer, name)
                    is getattr(pb_grpc.ParamServerServicer, name)]
  assert not_overridden == []
