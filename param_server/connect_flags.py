"""The flags every client of the parameter server shares (`rlax-ps train`, `worker`,
`status`): where it is, the bearer token, TLS; and `connect(role)` built from them.

The token comes from --token, else $RLAX_PS_<ROLE>_TOKEN, else the role's entry of
--token_file (the server's owner-only tokens.json), so no secret need be on a command line.
"""

from __future__ import annotations

import json
import os
import time

from absl import flags

from param_server import auth

DEFAULT_ADDRESS = "127.0.0.1:50051"

ADDRESS = flags.DEFINE_string("address", None, f"parameter server host:port (default "
                              f"{DEFAULT_ADDRESS}); ipv4:RELAY_IP:PORT,SERVER_IP:PORT: a "
                              f"weight relay, and the server should the relay not answer")
TOKEN = flags.DEFINE_string("token", None, "bearer token; else $RLAX_PS_<ROLE>_TOKEN, else "
                            "--token_file")
TOKEN_FILE = flags.DEFINE_string("token_file", None, "the server's tokens.json (owner-only); "
                                 "this client's role entry is used")
TLS_CA = flags.DEFINE_string("tls_ca", None, "PEM root certificate to trust (enables TLS)")
TLS_NAME = flags.DEFINE_string("tls_server_name", None, "name to expect in the server "
                               "certificate")


def await_file(path: str, timeout_s: float, poll_s: float = 0.2) -> None:
  """Return once `path` exists and is not empty (a server started beside this process
  writes its tokens.json at start); FileNotFoundError naming it after `timeout_s`."""
  end = time.monotonic() + timeout_s
  while not (os.path.exists(path) and os.path.getsize(path) > 0):
    if time.monotonic() >= end:
      raise FileNotFoundError(f"--token_file {path}: not written within {timeout_s:g}s; is "
                              f"the parameter server running?")
    time.sleep(poll_s)


def token_for(role: str, token: str | None = None, token_file: str | None = None) -> str:
  """The bearer token of `role`: given, else the environment, else the token file ('' if
  none). A token file without the role raises ValueError naming the file and role."""
  if token:
    return token
  if os.environ.get(auth.env_var(role)):
    return os.environ[auth.env_var(role)]
  if not token_file:
    return ""
  with open(token_file) as f:
    tokens = json.load(f)
  if not isinstance(tokens, dict) or not tokens.get(role):
    raise ValueError(f"--token_file {token_file}: expected a JSON object with a {role!r} "
                     f"token, found keys {sorted(tokens) if isinstance(tokens, dict) else []}")
  return tokens[role]


def connect(role: str, **client_kwargs):
  """A ParamServerClient for `role` from the flags above. gRPC is imported here, not with
  the flags: a worker blocks its stop signals before any gRPC thread starts."""
  from param_server.client import ParamServerClient
  root = None
  if TLS_CA.value:
    with open(TLS_CA.value, "rb") as f:
      root = f.read()
  return ParamServerClient(ADDRESS.value or DEFAULT_ADDRESS,
                           token=token_for(role, TOKEN.value, TOKEN_FILE.value), role=role,
                           root_certificates=root, tls_server_name=TLS_NAME.value,
                           **client_kwargs)

