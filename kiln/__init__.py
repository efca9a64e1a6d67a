"""Kiln: ahead-of-time compile-and-deploy toolchain for LLM inference."""
__version__ = "0.3.0"
