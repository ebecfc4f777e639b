"""`python -m rlax_ps ...` is the same as the `rlax-ps` console script."""

from rlax_ps.cli import main

if __name__ == "__main__":
  main()
