"""Bad input meets a clear ComFuseError that says what to do, never a TVM-internal crash."""

import pytest
import tvm
from tvm.script import tirx as T

import tvm_comfuse as cf


def test_analyze_rejects_non_modules():
    with pytest.raises(cf.ComFuseError, match="expected a tvm.IRModule"):
        cf.analyze("not a module")


def test_module_without_relax_function():
    @T.prim_func(s_tir=True)
    def add_one(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("b"):
                vi = T.axis.remap("S", [i])
                b[vi] = a[vi] + T.float32(1)

    mod = tvm.IRModule({"add_one": add_one})
    with pytest.raises(cf.ComFuseError, match="no Relax function"):
        cf.analyze(mod)
    assert cf.FuseComputeMemory()(mod).script() == mod.script()  # as a pass: nothing to do


@pytest.mark.parametrize("target, hint", [("cuda -arch=sm_90", "JSON dict"), ("nosuchkind", "tag"), ("{bad json", "JSON"), (42, "str, dict")])
def test_bad_targets(target, hint):
    with pytest.raises(cf.ComFuseError, match=hint):
        cf.get_pipeline(target)


def test_missing_database_directory(tmp_path):
    with pytest.raises(cf.ComFuseError, match="not a MetaSchedule log directory"):
        cf.get_pipeline("llvm", database=tmp_path / "nothing-here")


def test_unknown_group_kind():
    with pytest.raises(ValueError, match="unknown group kind"):
        cf.FuseComputeMemory(kinds=("gemm_everything",))


def test_targets_users_write_are_accepted():
    for target in ("llvm", "nvidia/nvidia-h100", {"kind": "cuda", "arch": "sm_90"}, '{"kind": "cuda", "arch": "sm_80"}'):
        assert cf.get_pipeline(target) is not None
    assert cf.parse_target("nvidia/nvidia-h100").attrs["arch"] == "sm_90a"
