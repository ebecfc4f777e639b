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
