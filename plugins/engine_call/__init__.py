"""How the runtime calls a CPU plan's compiled engine without holding the GIL (kernels.py,
csrc/engine_call.cpp): not an op of the model graph; a library shipped with the plan's kernels."""
