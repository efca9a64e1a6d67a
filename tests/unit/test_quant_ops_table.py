"""The op -> C++ file -> reference -> Triton kernel table at the top of plugins/quant/ops.py
says where each quant op lives, and stays true: every op is in it, its C++ file registers it
(and is compiled by plugins/quant/kernels.py), its reference exists, its Triton kernel too."""
import re
from pathlib import Path

import pytest

from kiln.plugins.quant import kernels, ops

pytestmark = pytest.mark.unit

QUANT = Path(ops.__file__).parent
ROW = re.compile(r"^    (linear_\w+)\s+(\S+\.cpp)\s+(\w+_reference)\s+(\S+)$", re.M)


def test_the_table_names_every_op_where_it_is_implemented():
    rows = ROW.findall(ops.__doc__)
    assert sorted(op for op, *_ in rows) == sorted(ops.SCHEMAS)
    triton_src = (QUANT / "triton_linear.py").read_text()
    for op, cpp, reference, triton in rows:
        source = QUANT / "csrc" / cpp
        assert source in kernels.SOURCES, cpp
        assert f'm.impl("{op}", ' in source.read_text(), (op, cpp)
        assert callable(getattr(ops, reference)), reference
        if triton != "-":
            assert f'@triton_op("kiln::{triton}"' in triton_src, triton


def test_each_cpp_file_registers_one_family():
    """Every compiled file registers ops, and every op is registered by exactly one file."""
    registered = {}
    for source in kernels.SOURCES:
        for op in re.findall(r'm\.impl\("(\w+)", ', source.read_text()):
            registered.setdefault(op, []).append(source.name)
    assert sorted(registered) == sorted(ops.SCHEMAS)
    assert all(len(files) == 1 for files in registered.values()), registered
