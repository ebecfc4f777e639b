"""The persistent compile cache: a folder that cannot be made leaves it off (said), a URL is
JAX's to read (no local folder of its name)."""

import os

import jax

from rlax_ps import compile_cache


def test_an_unmakeable_folder_leaves_the_cache_off_and_a_url_makes_no_local_folder(
    tmp_path, monkeypatch):
  updates = []
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  blocker = tmp_path / "file"
  blocker.write_text("")  # a folder under a file cannot be made (a read-only home alike)
  assert compile_cache.enable_compile_cache(str(blocker / "jax")) is None and updates == []
  monkeypatch.chdir(tmp_path)
  assert compile_cache.enable_compile_cache("gs://bucket/cache") == "gs://bucket/cache"
  assert ("jax_compilation_cache_dir", "gs://bucket/cache") in updates
  assert not os.path.exists(tmp_path / "gs:")  # (makedirs made ./gs:/bucket/cache)
