"""`import polytrain.compat.auto` as a script's first line runs the rest of it, and everything it
imports, with the CUDA shim active (see polytrain.compat)."""

from polytrain.backend.compat import install

install()
