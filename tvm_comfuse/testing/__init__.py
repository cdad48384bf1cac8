"""Testing helpers for tvm-comfuse (differential fuzzing against vanilla TVM)."""
