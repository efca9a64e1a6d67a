"""Kiln: ahead-of-time compile-and-deploy toolchain for LLM inference."""
__version__ = "0.3.0"
# The plan directory format this kiln writes and reads (runtime/plan.py has its history);
# here, torch-free, so the builder's quick up-to-date check can use it.
PLAN_FORMAT_VERSION = 3
