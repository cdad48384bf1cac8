"""Builder and runner: local, or MetaSchedule's RPCRunner through a TVM RPC tracker.

The tracker is checked up front (reachable, a free server under the key) because RPCRunner
otherwise waits for a server that never comes, or fails every candidate one by one.
"""

from __future__ import annotations

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


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """Builds candidates in this process with LocalBuilder's own build and export functions.

    LocalBuilder starts a fresh pool of Python workers for every batch, and each worker
    imports TVM inside the 30 s build timeout; on a small, loaded machine that start alone
    times out and every candidate is recorded as a build error. Building a PrimFunc takes
    a fraction of a second, so doing it here is faster and never loses a candidate. It
    lowers with ComFuse's TIR pipeline, as ``tvm_comfuse.compile`` does, so a tuned kernel
    is measured as it will run.
    """

    def build(self, build_inputs):
        results = []
        for item in build_inputs:
            try:
                mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(item.mod)  # as default_build
                with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):  # the tensor-core kernels' lowering
                    built = tvm.tirx.build(mod, target=item.target, pipeline=TIR_PIPELINE)
                results.append(ms.builder.BuilderResult(local_builder.default_export(built), None))
            except Exception as err:  # pylint: disable=broad-except  (a failed candidate, not a failed run)
                results.append(ms.builder.BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}"))
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
