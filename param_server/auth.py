"""Per-role bearer tokens, checked by a server interceptor before any handler runs.

Roles: `trainer` publishes weights, enqueues prompts and takes rollouts;
`worker` pulls, leases and submits; `viewer` reads versions and stats. Health
checking and reflection need no token. A missing or unknown token gets
UNAUTHENTICATED, a known token of the wrong role PERMISSION_DENIED. Tokens
are never logged; when none is given for a role, one is generated and saved in
`<storage_dir>/tokens.json`, readable by its owner only.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import ssl

import grpc
from absl import logging

from param_server.durable import write_durably

ROLES = ("trainer", "worker", "viewer")
SERVICE = "/rlax_ps.v1.ParamServer/"
TOKEN_FILE = "tokens.json"

_READ = {"trainer", "worker", "viewer"}
METHOD_ROLES: dict[str, set[str]] = {
    "Publish": {"trainer"},
    "GetLatest": _READ,
    "Pull": {"worker", "trainer"},
    "Watch": _READ,
    "EnqueuePrompts": {"trainer"},
    "LeasePrompts": {"worker"},
    "RenewLease": {"worker"},
    "CompleteLease": {"worker"},
    "ReleaseLease": {"worker"},
    "SubmitRollouts": {"worker"},
    "TakeRollouts": {"trainer"},
    "AckRollouts": {"trainer"},
    "RegisterWorker": {"worker"},
    "Heartbeat": {"worker"},
    "GetStats": _READ,
}
# Standard services anyone may call.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def env_var(role: str) -> str:
  return f"RLAX_PS_{role.upper()}_TOKEN"


class TokenStoreError(ValueError):
  """<storage_dir>/tokens.json cannot be read as role tokens; the message names the file."""


def warn_if_shared(path: str, what: str) -> None:
  """Log a warning when the token file `path` (given by `what`) is readable by other users."""
  try:
    mode = os.stat(path).st_mode & 0o777
  except OSError:
    return
  if mode & 0o077:
    logging.warning("auth: %s %s is readable by other users (mode %04o): they can act with "
                    "its tokens; chmod 600 it", what, path, mode)


def read_saved_tokens(path: str) -> dict[str, str]:
  """The role tokens saved in `path` ({} when absent); TokenStoreError naming the file when
  it is not a JSON object of strings (the server must not make new tokens over it)."""
  if not os.path.exists(path):
    return {}
  warn_if_shared(path, "token file")
  try:
    with open(path) as f:
      saved = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenStoreError(f"{path}: expected a JSON object of role tokens, not valid JSON "
                          f"({e}); mend it, or remove it to make new tokens") from None
  if not isinstance(saved, dict) or not all(isinstance(v, str) for v in saved.values()):
    raise TokenStoreError(f"{path}: expected a JSON object of role tokens (strings), got "
                          f"{type(saved).__name__}; mend it, or remove it to make new tokens")
  return saved


def normal_token(token) -> str:
  """`token` stripped of the whitespace a secret file or `echo` leaves (a newline), as
  clients and server both take it; ValueError unless it is then a non-empty string of
  printable ASCII, all a gRPC header carries."""
  if not isinstance(token, str):
    raise ValueError(f"expected a string token, got {type(token).__name__}")
  token = token.strip()
  if not token or not all(" " <= c <= "~" for c in token):
    raise ValueError(f"expected a token of printable ASCII characters (as `rlax-ps serve` "
                     f"writes them), got {len(token)} characters with others")
  return token


def _normal(token, where: str) -> str:
  try:
    return normal_token(token)
  except ValueError as e:
    raise TokenStoreError(f"{where}: {e}") from None


def load_tokens(storage_dir: str, given: dict[str, str | None]) -> dict[str, str]:
  """Role -> token: from `given` (flags), else the environment, else the token file (made if
  needed); each as clients take it (normal_token: a secret file's newline made a server that
  refused every client)."""
  tokens = {}
  for r in ROLES:
    if given.get(r):
      tokens[r] = _normal(given[r], f"--{r}_token")
    elif os.environ.get(env_var(r)):
      tokens[r] = _normal(os.environ[env_var(r)], f"${env_var(r)}")
    else:
      tokens[r] = ""
  missing = [r for r in ROLES if not tokens[r]]
  path = os.path.join(storage_dir, TOKEN_FILE)
  try:
    saved = read_saved_tokens(path)
  except (TokenStoreError, OSError):
    if missing:
      raise
    saved = {}  # (every token given: a file it cannot read is left as it is)
  # A role's entry other than the token given by flag or environment: a client reading it
  # (--token_file) would be refused; it goes, so that the client says there is none.
  stale = [r for r in ROLES if r not in missing and saved.get(r) not in (None, tokens[r])]
  for r in missing:
    tokens[r] = (_normal(saved[r], f"{path}: {r!r}") if saved.get(r)
                 else secrets.token_urlsafe(32))
  if stale or any(saved.get(r) != tokens[r] for r in missing):
    saved = {r: t for r, t in saved.items() if r not in stale}
    saved.update({r: tokens[r] for r in missing})
    write_durably(path, json.dumps(saved), mode=0o600)
  if stale:
    logging.warning("auth: %s's entries in %s removed: the server takes those tokens from "
                    "flags or the environment, and a client must too", ", ".join(stale), path)
  if missing:
    logging.info("auth: tokens for %s are in %s (owner-only)", ", ".join(missing), path)
  return _distinct(tokens)


def _distinct(tokens: dict[str, str]) -> dict[str, str]:
  """`tokens`, or TokenStoreError naming the roles given one token: a call with it would get one
  role's rights alone (the trainer's calls refused as a worker's)."""
  seen: dict[str, str] = {}
  for role, token in tokens.items():
    if token in seen:
      raise TokenStoreError(f"--{seen[token]}_token, --{role}_token: the {seen[token]} and {role} "
                       f"tokens are the same (flags, ${env_var(seen[token])} / "
                       f"${env_var(role)}, or {TOKEN_FILE}); give each role its own")
    seen[token] = role
  return tokens


def check_tls_files(cert: str, key: str) -> None:
  """ValueError naming the flags unless --tls_cert and --tls_key are both empty, or a PEM
  certificate and its private key that load together (gRPC says only that it could not
  bind)."""
  if not cert and not key:
    return
  if not cert or not key:
    given, missing = ("--tls_cert", "--tls_key") if cert else ("--tls_key", "--tls_cert")
    raise ValueError(f"{given}={cert or key}: TLS needs {missing} too")
  try:
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
  except (OSError, ssl.SSLError) as e:
    raise ValueError(f"--tls_cert={cert} --tls_key={key}: could not be loaded as a PEM "
                     f"certificate and its private key ({getattr(e, 'strerror', None) or e}); "
                     f"swapped?") from None


def _deny(code: grpc.StatusCode, message: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
  def abort(request, context):
    context.abort(code, message)
  if handler.request_streaming and handler.response_streaming:
    return grpc.stream_stream_rpc_method_handler(abort)
  if handler.request_streaming:
    return grpc.stream_unary_rpc_method_handler(abort)
  if handler.response_streaming:
    return grpc.unary_stream_rpc_method_handler(abort)
  return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.ServerInterceptor):
  """Maps `authorization: Bearer <token>` to a role and checks it against the method."""

  def __init__(self, tokens: dict[str, str], on_denied=None, methods=None, unavailable=None,
               unknown_hint: str = ""):
    self._tokens = [(role, tok.encode()) for role, tok in tokens.items()]
    # Added to the answer to a token it does not know (a relay: whom it serves).
    self._unknown_hint = unknown_hint
    self._on_denied = on_denied or (lambda: None)
    # unavailable() -> why the checked methods cannot be served now ("" when they can): a
    # relay whose server refused or cannot be reached answers UNAVAILABLE, not a verdict on
    # the caller's token, which it cannot judge then.
    self._unavailable = unavailable or (lambda: "")
    # Only these methods are checked here (None: all); a relay leaves the calls it passes
    # through to the server, which checks them.
    self._methods = None if methods is None else set(methods)

  def role_of(self, metadata) -> str | None:
    header = dict(metadata or ()).get("authorization", "")
    if not header.startswith("Bearer "):
      return None
    presented = header[len("Bearer "):].encode()
    role = None
    for r, tok in self._tokens:  # constant time per token, all checked
      if hmac.compare_digest(presented, tok):
        role = r
    return role

  def intercept_service(self, continuation, handler_call_details):
    method = handler_call_details.method
    if method.startswith(OPEN_PREFIXES):
      return continuation(handler_call_details)
    handler = continuation(handler_call_details)
    if handler is None:
      return None
    name = method[len(SERVICE):] if method.startswith(SERVICE) else method
    if self._methods is not None and name not in self._methods:
      return handler
    down = self._unavailable()
    if down:
      return _deny(grpc.StatusCode.UNAVAILABLE, down, handler)
    allowed = METHOD_ROLES.get(name, set())
    role = self.role_of(handler_call_details.invocation_metadata)
    if role is None:
      self._on_denied()
      logging.warning("auth: %s without a valid bearer token", name)
      given = dict(handler_call_details.invocation_metadata or ()).get("authorization")
      return _deny(grpc.StatusCode.UNAUTHENTICATED,
                   f"authorization: token rejected: not a known token{self._unknown_hint}"
                   if given else
                   "authorization: no token given: expected 'Bearer <token>'", handler)
    if role not in allowed:
      self._on_denied()
      logging.warning("auth: role %s may not call %s", role, name)
      return _deny(grpc.StatusCode.PERMISSION_DENIED,
                   f"authorization: role {role!r} may not call {name}; allowed: {sorted(allowed)}", handler)
    return handler
