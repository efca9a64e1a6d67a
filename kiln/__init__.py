"""Kiln: ahead-of-time compile-and-deploy toolchain for LLM inference."""
from kiln_contracts import KILN_VERSION as __version__  # noqa: F401  (one place: kiln_contracts)
