"""chosen.by_constant: a table's compiled function picked while compiling, by constant keys."""

import numba
import numpy as np
import pytest

from rlax_ps.sync import chosen, joint, loops, pack_coder


@numba.njit
def _plus(x, y):
  return x.sum() + y


@numba.njit
def _times(x, y):
  return x.sum() * y


_BY_INT = chosen.by_constant({1: _plus, 2: _times}, "by_int")
_BY_PAIR = chosen.by_constant({(1, True): _plus, (1, False): _times}, "by_pair")


def _caller(key: int, flag: bool):
  @numba.njit
  def call(x):
    return _BY_INT(key, (x, 3.0)) + 100 * _BY_PAIR((1, flag), (x, 2.0))
  return call


def test_the_constant_key_picks_the_function_in_compiled_code_and_in_python():
  x = np.arange(4.0)  # sums to 6
  assert _caller(1, True)(x) == (6 + 3) + 100 * (6 + 2)
  assert _caller(2, False)(x) == (6 * 3) + 100 * (6 * 2)
  assert _BY_INT(2, (x, 3.0)) == 18
  assert _BY_PAIR((1, True), (x, 2.0)) == 8


def test_a_key_known_only_at_run_time_is_refused_while_compiling():
  @numba.njit
  def call(key, x):
    return _BY_INT(key, (x, 1.0))
  with pytest.raises(numba.core.errors.TypingError):
    call(np.int64(1), np.ones(2))


def test_a_key_not_in_the_table_is_named():
  with pytest.raises(numba.core.errors.TypingError,
                     match=r"by_int: no compiled function for key \(3,\)"):
    _caller(3, True)(np.ones(2))


@pytest.mark.parametrize("table", [pack_coder._CODERS, pack_coder._APPLIERS, joint._ENCODERS,
                                   joint._SAMPLERS, joint._ROUND_DECODERS])
def test_compiled_closures_hold_only_constants_so_numba_can_cache_them(table):
  """numba keys a closure's cache entry by its cells' pickled contents: a cell holding a
  dispatcher pickles differently in every process, and its cache would never be read."""
  for fn in table.values():
    cells = [c.cell_contents for c in fn.py_func.__closure__ or ()]
    assert cells and all(type(c) in (int, bool) for c in cells), fn
    assert fn._cache.__class__.__name__ == "FunctionCache"  # cache=True


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
def test_the_scan_is_chosen_by_lane_width(dtype):
  old = np.zeros(64, dtype)
  new = old.copy()
  new[[3, 40]] = 1
  st = np.array([0, -1, 0], np.int64)
  gaps, syms = np.zeros(128, np.uint32), np.zeros(128, np.uint8)
  raw, hist = np.zeros(40, np.uint64), np.zeros((4, loops.ALPHABET), np.int64)
  loops.scan_chosen(8 * old.itemsize, (old.view(np.uint64), new.view(np.uint64), old, new, 0,
                                       st, gaps, syms, raw, hist))
  assert st[0] == 2  # both changes found
  np.testing.assert_array_equal(gaps[:2], [3, 36])
