"""Kiln: ahead-of-time compile-and-deploy toolchain for LLM inference."""
from kiln.contracts import KILN_VERSION as __version__  # noqa: F401  (one place: kiln.contracts)
