"""The flags every client of the parameter server shares (`rlax-ps train`, `worker`,
`status`): where it is, the bearer token, TLS; and `connect(role)` built from them.

The token comes from --token, else $RLAX_PS_<ROLE>_TOKEN, else the role's entry of
--token_file (the server's owner-only tokens.json), so no secret need be on a command line.
"""

from __future__ import annotations

import json
import os
import ssl
import time

from absl import app, flags, logging

from param_server import auth

DEFAULT_ADDRESS = "127.0.0.1:50051"

ADDRESS = flags.DEFINE_string("address", None, f"parameter server host:port (default "
                              f"{DEFAULT_ADDRESS}); ipv4:RELAY_IP:PORT,SERVER_IP:PORT: a "
                              f"weight relay, and the server while the relay does not answer or "
                              f"serve (the relay is tried again each minute)")
TOKEN = flags.DEFINE_string("token", None, "bearer token; else $RLAX_PS_<ROLE>_TOKEN, else "
                            "--token_file")
TOKEN_FILE = flags.DEFINE_string("token_file", None, "the server's tokens.json (owner-only); "
                                 "this client's role entry is used")
TLS_CA = flags.DEFINE_string("tls_ca", None, "PEM root certificate to trust (enables TLS)")
TLS_NAME = flags.DEFINE_string("tls_server_name", None, "name to expect in the server "
                               "certificate")


class TokenFileError(ValueError):
  """--token, its environment variable or --token_file could not give this client's token; the
  message names the flag (and path)."""


def require_address() -> None:
  """Make --address required for the calling command, its help claiming no default."""
  flags.mark_flag_as_required("address")
  flags.FLAGS["address"].help = ("parameter server host:port (required); "
                                 "ipv4:RELAY_IP:PORT,SERVER_IP:PORT: a weight relay, and the "
                                 "server while the relay does not answer or serve (the relay "
                                 "is tried again each minute)")


def await_file(path: str, timeout_s: float, poll_s: float = 0.2) -> None:
  """Return once `path` exists and is not empty (a server started beside this process
  writes its tokens.json at start); FileNotFoundError naming it after `timeout_s`."""
  end = time.monotonic() + timeout_s
  while not (os.path.exists(path) and os.path.getsize(path) > 0):
    if time.monotonic() >= end:
      raise FileNotFoundError(f"--token_file {path}: not written within {timeout_s:g}s; is "
                              f"the parameter server running?")
    time.sleep(poll_s)


def token_for(role: str, token: str | None = None, token_file: str | None = None,
              wait_s: float = 0.0) -> str:
  """The bearer token of `role`: given, else the environment, else the token file ('' if
  none). Only then, and only while the file is missing, wait up to `wait_s` for it (a
  server started beside this process writes it), saying so at once. TokenFileError (a
  ValueError) names the flag and path when the file is missing, not JSON or lacks the role."""
  if token:
    return _checked_token(token, "--token")
  if os.environ.get(auth.env_var(role)):
    return _checked_token(os.environ[auth.env_var(role)], f"${auth.env_var(role)}")
  if not token_file:
    return ""
  if wait_s > 0 and not (os.path.exists(token_file) and os.path.getsize(token_file) > 0):
    logging.warning("waiting up to %gs for --token_file %s (`rlax-ps serve` writes it when it "
                    "starts); --token or $%s needs no wait", wait_s, token_file,
                    auth.env_var(role))
    try:
      await_file(token_file, wait_s)
    except FileNotFoundError as e:
      raise TokenFileError(str(e)) from None
  auth.warn_if_shared(token_file, "--token_file")
  try:
    with open(token_file) as f:
      tokens = json.load(f)
  except FileNotFoundError:
    raise TokenFileError(f"--token_file {token_file}: no such file (`rlax-ps serve "
                         f"--storage_dir=DIR` writes DIR/{auth.TOKEN_FILE})") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenFileError(f"--token_file {token_file}: not valid JSON ({e})") from None
  except OSError as e:
    raise TokenFileError(f"--token_file {token_file}: {e.strerror or e}") from None
  if not isinstance(tokens, dict) or not tokens.get(role):
    raise TokenFileError(f"--token_file {token_file}: expected a JSON object with a {role!r} "
                         f"token, found keys {sorted(tokens) if isinstance(tokens, dict) else []} "
                         f"(a server given its {role} token by --{role}_token or "
                         f"${auth.env_var(role)} keeps none there: pass that token with --token "
                         f"or ${auth.env_var(role)})")
  return _checked_token(tokens[role], f"--token_file {token_file}: {role!r}")


# gRPC target schemes: the address is theirs to read (ipv4:A:PORT,B:PORT, dns:///host:port).
_TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def _checked_token(token, where: str) -> str:
  """The token as the server takes it (auth.normal_token: stripped of the newline `echo` or
  a secret file leaves, which gRPC refuses as "Invalid metadata", naming no token);
  TokenFileError naming `where` for one a header cannot carry."""
  try:
    return auth.normal_token(token)
  except ValueError as e:
    raise TokenFileError(f"{where}: {e}") from None


def check_address(address: str) -> None:
  """app.UsageError naming --address unless it is host:port with a port in 1..65535 (gRPC
  would quietly try 443 without one, wrap 99999 to another port, retry 'abc' for the
  whole timeout), [v6]:port for IPv6, or a gRPC target (ipv4:A:PORT,B:PORT, dns:///h:p)."""
  scheme = address.partition("://")[0]
  if scheme in ("http", "https", "grpc", "grpcs"):
    raise app.UsageError(f"--address={address}: expected host:port, not a URL (drop "
                         f"'{scheme}://'; TLS is --tls_ca)")
  if address.startswith(_TARGET_SCHEMES):
    return
  if address.startswith("["):
    host, _, port = address[1:].partition("]")
    port = port[1:] if port.startswith(":") else None
  else:
    host, colon, port = address.rpartition(":")
    if ":" in host:
      raise app.UsageError(f"--address={address}: expected host:port; an IPv6 host goes in "
                           f"brackets, e.g. [{address}]:50051 or [::1]:50051")
    port = port if colon else None
  if not port:
    raise app.UsageError(f"--address={address}: expected host:port, got no port (the "
                         f"server's --port, e.g. {host or address}:50051)")
  if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535) or not host:
    raise app.UsageError(f"--address={address}: expected host:port with a host and a port "
                         f"in 1..65535 (the server's --port), got {host!r} and {port!r}")


def read_tls_ca(path: str) -> bytes:
  """The PEM root certificate(s) in `path`; app.UsageError naming --tls_ca when it cannot be
  read or holds no certificate (gRPC would only fail every handshake)."""
  try:
    ssl.create_default_context(cafile=path)
    with open(path, "rb") as f:
      return f.read()
  except (OSError, ssl.SSLError) as e:
    raise app.UsageError(f"--tls_ca={path}: expected a PEM certificate (the server's "
                         f"--tls_cert or the CA that signed it), could not load it "
                         f"({getattr(e, 'strerror', None) or e})") from None


def connect(role: str, token_wait_s: float = 0.0, **client_kwargs):
  """A ParamServerClient for `role` from the flags above (`token_wait_s`: how long to wait
  for a --token_file not yet written). gRPC is imported here, not with the flags: a worker
  blocks its stop signals before any gRPC thread starts."""
  from param_server.client import ParamServerClient
  check_address(ADDRESS.value or DEFAULT_ADDRESS)
  if TLS_NAME.value and not TLS_CA.value:  # (it was ignored: plaintext, the token in clear)
    raise app.UsageError(f"--tls_server_name={TLS_NAME.value}: expected with --tls_ca (the "
                         f"server's certificate or its CA), which turns TLS on; got none")
  root = read_tls_ca(TLS_CA.value) if TLS_CA.value else None
  return ParamServerClient(ADDRESS.value or DEFAULT_ADDRESS,
                           token=token_for(role, TOKEN.value, TOKEN_FILE.value, token_wait_s),
                           role=role,
                           root_certificates=root, tls_server_name=TLS_NAME.value,
                           **client_kwargs)

