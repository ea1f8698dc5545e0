"""Rewrite the README support table from support_matrix(): `python -m jax_nkilib._src.tools.readme README.md`."""

import sys

import jax_nkilib  # noqa: F401  (binds every kernel)
from jax_nkilib._src.tools.support import write_readme

if __name__ == "__main__":
    write_readme(sys.argv[1] if len(sys.argv) > 1 else "README.md")
