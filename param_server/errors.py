"""Request failures raised by the stores and turned into gRPC statuses by the server.

Each carries the gRPC code and the field it is about, so every rejection reads
`<field>: <what was expected>, got <what was received>`.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
  """A rejected request; raised before any state changes."""

  code = grpc.StatusCode.INVALID_ARGUMENT

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field
    self.message = message


class InvalidArgument(RequestError):
  code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(RequestError):
  code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(RequestError):
  code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(RequestError):
  code = grpc.StatusCode.RESOURCE_EXHAUSTED


# How a server (or relay) serving its most pulls at once begins its answer to one more: the
# client waits and asks again, on the same route (the server is up: no retry deadline runs).
PULLS_BUSY = "pulls: busy:"


class Busy(ResourceExhausted):
  """Every slot of a kind of stream is taken: flow control, not bad input (counted and
  logged apart from rejections); come back shortly."""

  def __init__(self, field: str, message: str):
    super().__init__(field, f"busy: {message}")


class PullsBusy(Busy):
  """Every pull slot is taken (ServerConfig.max_pulls)."""

  def __init__(self, message: str):
    super().__init__("pulls", message)



class Unavailable(RequestError):
  """Not served now, worth retrying (a relay's link to the server stalled)."""
  code = grpc.StatusCode.UNAVAILABLE
