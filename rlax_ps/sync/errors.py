"""The one exception the weight-sync codec raises for bad or mismatched input."""


class CodecError(Exception):
  """An update cannot be decoded or does not fit the weights it is applied to.

  The message names the tensor whenever the problem belongs to one tensor.
  """
