"""CPU ISA levels: features derived from compiler flags, and plans loaded or refused against
synthetic /proc/cpuinfo flag sets of real CPU generations (whatever this host is)."""
from __future__ import annotations

import inspect
import platform
import shutil

import pytest

from kiln.plugins import isa
from kiln.contracts.manifest import TargetSection
from kiln.runtime.plan import PlanError, check_target as check_plan_target

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("c++"),
                                 reason="needs an x86-64 C++ compiler")]

_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx "
         "fxsr sse sse2 ht syscall nx lm constant_tsc pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 "
         "x2apic movbe popcnt aes xsave rdrand hypervisor lahf_lm")
CPUS = {  # name -> (/proc/cpuinfo flags, the level it runs best)
    "nehalem": (_BASE.replace(" xsave", ""), "none"),
    "haswell": (_BASE + " avx f16c fma avx2 bmi1 bmi2", "avx2"),
    "skylake-x": (_BASE + " avx f16c fma avx2 bmi1 bmi2 avx512f avx512dq avx512cd avx512bw "
                  "avx512vl", "avx512"),
    "cascade-lake": (_BASE + " avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl "
                     "avx512_vnni", "avx512_vnni"),
    "zen4": (_BASE + " avx f16c fma avx2 avx512f avx512dq avx512ifma avx512cd avx512bw "
             "avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni "
             "avx512_bitalg avx512_vpopcntdq", "avx512_bf16"),
    "sapphire-rapids": (_BASE + " avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw "
                        "avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 "
                        "avx512_fp16", "amx"),
}


def cpuinfo(name: str) -> set[str]:
    return isa.cpu_flags(f"processor\t: 0\nflags\t\t: {CPUS[name][0]}\n")


def check_target(m: dict, path: str, machine: dict) -> None:
    """kiln.runtime.plan.check_target on the target (and spec) of a partial manifest."""
    check_plan_target(TargetSection.from_json(m["target"], "target"), path, machine,
                      spec_path=m["spec_path"], pinned_isa=m["spec"]["target"]["isa"])


def manifest_for(level: str) -> dict:
    lv = isa.LEVELS[level]
    return {"target": {"device": "cpu", "arch": platform.machine(), "isa": level,
                       "isa_flags": list(isa.compile_flags(lv)),
                       "cpu_features": isa.compiler_features(lv.flags)},
            "spec": {"target": {"isa": level}}, "spec_path": "model_specs/x.yaml"}


@pytest.mark.parametrize("level", isa.LEVEL_NAMES)
def test_level_features_come_from_the_compiler(level):
    lv = isa.LEVELS[level]
    feats = isa.compiler_features(lv.flags)
    if level == "none":
        assert feats == [] and lv.vector_bits == 0
        return
    assert feats, level
    # every flag the level names shows up as a feature (the compiler was really asked)
    assert not isa.missing_features(isa.flag_features(lv.flags), feats)
    assert "f16c" in feats and "fma" in feats and "avx2" in feats


def test_levels_are_ordered_supersets():
    prev: list[str] = []
    for level in isa.LEVEL_NAMES:
        feats = isa.compiler_features(isa.LEVELS[level].flags)
        assert set(prev) <= set(feats), level
        prev = feats


def _torch_isa_classes():
    from torch._inductor import cpu_vec_isa as cvi

    classes = [c for _, c in inspect.getmembers(cvi, inspect.isclass)
               if issubclass(c, cvi.VecISA) and c not in (cvi.VecISA, cvi.InvalidVecISA)]
    assert len(classes) >= 6, classes   # AVX2, AVX512, AVX512VNNI, AMX, NEON, SVE, ...
    return classes


@pytest.mark.parametrize("cls", _torch_isa_classes(), ids=lambda c: c.__name__)
def test_every_torch_isa_class_maps_to_a_level_that_covers_it(cls):
    """Whatever ISA classes torch defines: an x86 one's flags give a non-empty feature list,
    some kiln level generates code with at least those features (its pinned class is that
    class or a subclass of it), and each CPU generation below loads or refuses that level's
    plans by features alone."""
    obj = cls(256) if "SVE" in cls.__name__ else cls()
    flags = obj._arch_flags.split() if isinstance(obj._arch_flags, str) else []
    if not any(f.startswith("-mavx") for f in flags):
        pytest.skip(f"{cls.__name__} is not an x86 ISA ({flags or 'no flags'})")
    torch_feats = isa.compiler_features(flags)
    assert torch_feats
    covering = [lv for lv in isa.LEVELS.values() if lv.torch_isa == cls.__name__]
    assert covering, f"no kiln level generates code for torch's {cls.__name__}"
    for lv in covering:
        assert not isa.missing_features(torch_feats, isa.compiler_features(lv.flags))
        for cpu in CPUS:
            have = cpuinfo(cpu)
            missing = isa.missing_features(isa.compiler_features(lv.flags), have)
            if missing:
                with pytest.raises(PlanError) as e:
                    check_target(manifest_for(lv.name), "p", {"arch": platform.machine(),
                                 "cpu_flags": have, "compute_capability": None})
                assert all(f in str(e.value) for f in missing)
            else:
                check_target(manifest_for(lv.name), "p", {"arch": platform.machine(),
                             "cpu_flags": have, "compute_capability": None})


@pytest.mark.parametrize("cpu", list(CPUS))
def test_host_level_of_each_cpu_generation(cpu):
    assert isa.host_level(cpuinfo(cpu)).name == CPUS[cpu][1]
    assert isa.best_level(cpuinfo(cpu)).name == CPUS[cpu][1]   # the runtime's compiler-free view


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("level", isa.LEVEL_NAMES)
def test_plan_loads_exactly_where_its_features_are(cpu, level):
    machine = {"arch": platform.machine(), "cpu_flags": cpuinfo(cpu), "compute_capability": None}
    order = list(isa.LEVEL_NAMES)
    runs = order.index(level) <= order.index(CPUS[cpu][1])
    if runs:
        check_target(manifest_for(level), "p", machine)
        return
    with pytest.raises(PlanError) as e:
        check_target(manifest_for(level), "p", machine)
    msg = str(e.value)
    missing = isa.missing_features(manifest_for(level)["target"]["cpu_features"],
                                   machine["cpu_flags"])
    assert missing and all(f in msg for f in missing)
    # the fix names a level this CPU runs, not the refused one again
    assert f"target.isa: {CPUS[cpu][1]}" in msg and "kiln build model_specs/x.yaml" in msg


def test_unknown_feature_is_refused_by_name():
    m = manifest_for("avx2")
    m["target"]["cpu_features"].append("avx10_2")
    with pytest.raises(PlanError, match="lacks avx10_2"):
        check_target(m, "p", {"arch": platform.machine(), "cpu_flags": cpuinfo("zen4"),
                              "compute_capability": None})


def test_plan_without_feature_list_is_refused():
    m = manifest_for("avx2")
    del m["target"]["cpu_features"]
    with pytest.raises(PlanError, match="does not record the CPU features"):
        check_target(m, "p", {"arch": platform.machine(), "cpu_flags": cpuinfo("zen4"),
                              "compute_capability": None})


def test_spelling_differences_between_compiler_and_cpuinfo():
    # __SSE3__ is cpuinfo's pni, __AVX512VNNI__ its avx512_vnni, __CRC32__ part of sse4_2
    assert isa.cpuinfo_name("SSE3") == "pni"
    assert isa.cpuinfo_name("AVX512VNNI") == "avx512_vnni"
    assert not isa.missing_features(["pni", "crc32", "avx512vnni"],
                                    {"pni", "sse4_2", "avx512_vnni"})


def test_build_refuses_a_level_the_build_machine_lacks():
    from kiln.builder.target import TargetError, resolve_level

    with pytest.raises(TargetError) as e:
        resolve_level("avx512_vnni", "spec.yaml", have=cpuinfo("haswell"))
    msg = str(e.value)
    assert "avx512f" in msg and "avx512_vnni" in msg and "target.isa: avx2" in msg
    assert resolve_level("avx2", have=cpuinfo("zen4")).name == "avx2"   # lower: fine
    assert resolve_level("auto", have=cpuinfo("skylake-x")).name == "avx512"
