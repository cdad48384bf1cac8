"""Builder and runner: local, or MetaSchedule's RPCRunner through a TVM RPC tracker.

The tracker is checked up front (reachable, a free server under the key) because RPCRunner
otherwise waits for a server that never comes, or fails every candidate one by one.
"""

from __future__ import annotations

import os
import socket

import tvm
from tvm import rpc
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import local_builder
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

from ..errors import ComFuseError
from ..schedule.lowering import PASS_CONFIG, TIR_PIPELINE

#: Timing of one candidate: TVM's default repeat, 3 runs, at least 50 ms per measurement.
EVALUATOR = dict(number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False)


def parse_tracker(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ComFuseError(f"--rpc-tracker {text!r} is not HOST:PORT (e.g. 127.0.0.1:9190)")
    return host, int(port)


def check_tracker(host: str, port: int, key: str) -> None:
    """Raise :class:`ComFuseError` unless the tracker answers and has a server under ``key``."""
    try:
        socket.create_connection((host, port), timeout=5).close()  # fail fast: connect_tracker retries for a minute
        summary = rpc.connect_tracker(host, port).summary()
    except Exception as err:  # pylint: disable=broad-except  (socket errors, RPC errors)
        raise ComFuseError(f"cannot reach the RPC tracker at {host}:{port} ({err}). Start one with "
                           f"`python -m tvm.exec.rpc_tracker --host {host} --port {port}`.") from None
    queue = summary.get("queue_info", {})
    if key not in queue:
        raise ComFuseError(
            f"the RPC tracker at {host}:{port} has no server under key {key!r} (keys: {sorted(queue) or 'none'}). "
            f"Register one with `python -m tvm.exec.rpc_server --tracker {host}:{port} --key {key}`."
        )


#: Machines with this many cores build candidates in a pool of worker processes.
POOL_CORES = 8


def build_module(mod: tvm.IRModule, target: tvm.target.Target, _params=None) -> tvm.runtime.Module:
    """Build one candidate as ``tvm_comfuse.compile`` will: lowered with ComFuse's TIR pipeline
    (the tensor-core kernels' workarounds), or, for a Hopper post-norm candidate, its kernel
    (:func:`tvm_comfuse.tune.hopper.build_candidate`)."""
    from . import hopper  # pylint: disable=import-outside-toplevel

    if hopper.description_of(mod) is not None:
        return hopper.build_candidate(mod)
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)  # as default_build
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
        return tvm.tirx.build(mod, target=target, pipeline=TIR_PIPELINE)


#: Seconds a candidate may take to build (LocalBuilder's default is 30: too short for nvcc on a
#: loaded machine, see :class:`InProcessBuilder`); the vanilla MetaSchedule contender gets the same.
BUILD_TIMEOUT_S = 120.0


def worker_pool(workers: int | None = None) -> ms.builder.Builder:
    """MetaSchedule's LocalBuilder with :func:`build_module`: a fresh pool of worker processes per batch."""
    return ms.builder.LocalBuilder(max_workers=workers, timeout_sec=BUILD_TIMEOUT_S, f_build=build_module)


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """Builds candidates with :func:`build_module`: in this process on small machines, in a
    pool of worker processes (:func:`worker_pool`) on machines of :data:`POOL_CORES` or more.

    LocalBuilder starts a fresh pool of Python workers for every batch, and each worker
    imports TVM inside its build timeout; on a small, loaded machine (CI's two cores) that
    start alone timed out and every candidate was recorded as a build error, while building a
    PrimFunc takes a fraction of a second. On a GPU machine the pool pays: a batch of 64
    builds in parallel. The Hopper post-norm kernel's candidates always go to the pool:
    generating one takes ~1 s of Python.
    """

    def build(self, build_inputs):
        from . import hopper  # pylint: disable=import-outside-toplevel

        many = (os.cpu_count() or 1) >= POOL_CORES
        pooled = [i for i, item in enumerate(build_inputs) if many or hopper.description_of(item.mod) is not None]
        results = [None] * len(build_inputs)
        if pooled:
            for i, result in zip(pooled, worker_pool().build([build_inputs[i] for i in pooled])):
                results[i] = result
        for i, item in enumerate(build_inputs):
            if results[i] is None:
                try:
                    results[i] = ms.builder.BuilderResult(local_builder.default_export(build_module(item.mod, item.target)), None)
                except Exception as err:  # pylint: disable=broad-except  (a failed candidate, not a failed run)
                    results[i] = ms.builder.BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}")
        return results


def builder() -> ms.builder.Builder:
    return InProcessBuilder()


def runner(tracker: str | None, key: str | None) -> ms.runner.Runner:
    """LocalRunner, or RPCRunner when ``tracker`` is given (``key`` is then required)."""
    evaluator = ms.runner.EvaluatorConfig(**EVALUATOR)
    if tracker is None:
        if key is not None:
            raise ComFuseError("--rpc-key needs --rpc-tracker HOST:PORT")
        return ms.runner.LocalRunner(evaluator_config=evaluator)
    if not key:
        raise ComFuseError("--rpc-tracker needs --rpc-key KEY (the key the RPC server registered under)")
    host, port = parse_tracker(tracker)
    check_tracker(host, port, key)
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key, session_timeout_sec=60)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator, max_workers=1)
