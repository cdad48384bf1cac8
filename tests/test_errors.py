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


def test_unsupported_dtype_is_left_to_vanilla_and_says_why():
    from tvm import relax  # pylint: disable=import-outside-toplevel

    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType((16, 32), "int8")), relax.Var("w", relax.TensorType((32, 24), "int8"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(x, w, out_dtype="int32")), "float32"))
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(y, axis=-1)))
        bb.emit_func_output(out)
    mod = bb.get()
    (group,) = cf.analyze(mod)
    assert not group.fused and "int32" in group.note and "vanilla" in group.note
    assert "int32" in cf.format_groups([group])
    assert cf.FuseComputeMemory()(mod).attrs is None or not cf.FuseComputeMemory()(mod).attrs.get("comfuse.groups")
    cf.compile(mod, "llvm")  # still compiles, as vanilla TVM would


def test_unknown_group_kind():
    with pytest.raises(ValueError, match="unknown group kind"):
        cf.FuseComputeMemory(kinds=("gemm_everything",))


def test_targets_users_write_are_accepted():
    for target in ("llvm", "nvidia/nvidia-h100", {"kind": "cuda", "arch": "sm_90"}, '{"kind": "cuda", "arch": "sm_80"}'):
        assert cf.get_pipeline(target) is not None
    assert cf.parse_target("nvidia/nvidia-h100").attrs["arch"] == "sm_90a"
