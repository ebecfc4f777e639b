"""Compiled calls to one of a table's compiled functions, chosen while compiling.

The one-call paths (pack_coder.py) need joint's and loops' kernels for one lane width, way
of listing changes or decoder width: constants of each compiled specialisation. Inlining
the kernels' bodies there compiled each of them again, inside functions so large that
numba took minutes to type them (and a fresh worker pays every compile). A call through
`by_constant` instead links the kernel's own compiled (and cached) specialisation: the
key is read from the argument's literal type, so nothing is chosen at run time, and no
dispatcher is held in a closure (numba hashes closures' contents into its cache keys, and
a dispatcher pickles differently in every process).
"""

import numba
from numba.extending import overload

_CONSTANT = (numba.types.IntegerLiteral, numba.types.BooleanLiteral)


def by_constant(table: dict, name: str):
  """f(key, args) for compiled code: table[key](*args), where key (an int or bool, or a
  tuple of them) is a compile-time constant there (a closure's constant or a literal) and
  args a tuple. Called from Python it does the same."""
  def call(key, args):
    return table[key](*args)

  call.__name__ = call.__qualname__ = name

  @overload(call, inline="always")
  def _typed(key, args):
    parts = tuple(key) if isinstance(key, numba.types.BaseTuple) else (key,)
    if not all(isinstance(p, _CONSTANT) for p in parts):
      return None  # numba retries with the literal types
    values = tuple(p.literal_value for p in parts)
    fn = table.get(values if isinstance(key, numba.types.BaseTuple) else values[0])
    if fn is None:
      raise numba.core.errors.TypingError(
          f"{name}: no compiled function for key {values}; it has {sorted(table)}")

    def impl(key, args):
      return fn(*args)
    return impl

  return call
