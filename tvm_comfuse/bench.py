"""Benchmark of the post-norm suite on a GPU: ComFuse against every contender, one process.

The GEMM is PyTorch's ``nn.Linear`` (weight ``[N, K]``), as models import. For each shape,
norm and dtype, the same inputs go to: cuBLAS GEMM alone (the floor),
PyTorch eager, torch.compile (default, and max-autotune when asked), vanilla TVM (its
default pipeline: DLight; and, when asked, tuned by MetaSchedule's stock rules with the trial
budget ComFuse's logs had) and ComFuse (its default pipeline: on sm_90 the Hopper wgmma
kernels; ``comfuse_mma_sync``: the portable mma.sync rule, untuned; ``comfuse_tuned``: the
default pipeline with the shipped tuning logs, the wgmma kernels' tuned configurations on sm_90;
``comfuse_hopper_all``: the pipeline with every Hopper kernel, the opt-in ``split_norm`` too
(session 17: post-norms as the GEMM with row statistics + a norm kernel); ``sdpa``,
attention only: PyTorch's ``scaled_dot_product_attention``, flash attention on the H200). Each contender's output is checked against a float32
PyTorch reference before it is timed; a wrong result is reported and not timed. Two times
per call: device time (sum of kernel durations from the CUDA profiler, so launch and VM
overhead are excluded) and wall time (CUDA events around back-to-back calls, best of 3).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass

from . import workloads
from .pipeline import HOPPER_GROUPS
from .runtime import compile_module

CONTENDERS = ("cublas_gemm", "eager", "inductor", "inductor_max_autotune", "tvm_dlight", "tvm_metaschedule", "comfuse",
              "comfuse_mma_sync", "comfuse_tuned", "comfuse_hopper_all", "sdpa")
#: MetaSchedule trials per task for ``tvm_metaschedule``: the budget ``comfuse tune`` gave the
#: shipped logs (64 per shape, one ComFuse task each).
VANILLA_TRIALS = 64
#: Where ``comfuse_tuned`` reads its logs: ``tuning_logs/<target>/<shape name>/`` (``comfuse tune``).
TUNED_TARGET = "nvidia/nvidia-h100"
#: Max |out - fp32 reference| accepted; LayerNorm outputs are O(1), softmax outputs O(1/N).
TOLERANCE = {"float16": 5e-2, "bfloat16": 2e-1}


@dataclass
class Row:
    """One measured (shape, norm, dtype, contender)."""

    shape: str
    M: int
    K: int
    N: int
    norm: str
    dtype: str
    contender: str
    max_abs_err: float | None = None
    kernel_us: float | None = None
    wall_us: float | None = None
    kernels_per_call: float | None = None
    #: Device µs per call of each kernel (by name, the most expensive first; the rest summed as
    #: "(other)"): where a whole model's time goes, fused groups against the unfused rest.
    breakdown: dict | None = None
    error: str | None = None


def _torch_compile(torch, fn, **kwargs):
    """``torch.compile(fn, **kwargs)`` with TorchDynamo's caches emptied first. Why: Dynamo keys
    its cache by code object, and every case of a run compiles the same function (a new closure,
    the same code), so from the ninth case on it hit its recompile limit and ran the function
    eagerly, timed as torch.compile: the tenth case of session 24's softmax run (16384 x 256 ->
    1024 in fp16 and bf16: 96.1 us, eager's kernels, where a run of five had torch.compile's
    58.2). Compiles are lazy, so emptying the caches drops no contender of the case being built."""
    torch._dynamo.reset()  # pylint: disable=protected-access
    return torch.compile(fn, **kwargs)


def _torch_postnorm(torch, x, w, b, r, g, be, norm):
    """``norm(x @ w.T + b + r)``: ``w`` is ``[N, K]``, PyTorch's nn.Linear layout."""
    f = torch.nn.functional
    y = f.linear(x, w, b) + r
    n = y.shape[-1]
    if norm == "layer_norm":
        return f.layer_norm(y, (n,), g, be, workloads.EPS)
    if norm == "rms_norm":
        return f.rms_norm(y, (n,), g, workloads.EPS)
    return torch.softmax(y, dim=-1)


def wall_us(torch, fn, iters: int = 100) -> float:
    """Best of 3 of the mean wall time per call over ``iters`` back-to-back calls (µs)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters * 1e3)
    return best


def kernel_us(torch, fn, iters: int = 20, top: int = 16) -> tuple:
    """Device time per call (sum of CUDA kernel durations, µs), kernels per call, and the time
    per call of the ``top`` most expensive kernel names (the rest as ``"(other)"``)."""
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / iters
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    breakdown = {name[:160]: round(us, 2) for name, us in ranked[:top]}
    if len(ranked) > top:
        breakdown["(other)"] = round(sum(us for _, us in ranked[top:]), 2)
    return sum(e.device_time for e in events) / iters, len(events) / iters, breakdown


def _tvm_callable(torch, mod, args, comfuse: bool, target, database=None, hopper: bool | None = None, hopper_groups=None):
    ex = compile_module(mod, target, comfuse=comfuse, database=database, hopper=hopper, hopper_groups=hopper_groups)
    return _vm_callable(torch, ex, args)


def _vm_callable(torch, ex, args):
    """``(run, run_and_return_output)`` for a built Relax executable on the GPU."""
    import tvm  # pylint: disable=import-outside-toplevel

    f = tvm.relax.VirtualMachine(ex, tvm.cuda(0))["main"]
    tvm_args = [tvm.runtime.from_dlpack(a) for a in args]

    def first(out):  # an imported model returns a one-element tuple
        return out[0] if isinstance(out, (tvm.ir.Array, list, tuple)) else out

    return lambda: f(*tvm_args), lambda: torch.from_dlpack(first(f(*tvm_args)))


def _vanilla_tuned_callable(torch, mod, args, target, trials: int = VANILLA_TRIALS, work_dir: str | None = None):
    """The vanilla MetaSchedule contender: its tuning logs in ``work_dir`` (kept: the records a
    plot of its best latency against trials reads), else in a temporary directory."""
    import contextlib  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    from .runtime import compile_vanilla_tuned  # pylint: disable=import-outside-toplevel

    where = contextlib.nullcontext(work_dir) if work_dir is not None else tempfile.TemporaryDirectory(prefix="comfuse-bench-ms-")
    with where as logs:
        ex = compile_vanilla_tuned(mod, target, trials, logs)
    return _vm_callable(torch, ex, args)


def _contenders(torch, shape, norm, dtype, args, which, target, vanilla_logs=None):
    x, w = args[0], args[1]
    post = lambda: _torch_postnorm(torch, *args, norm)  # noqa: E731
    out = {}
    if "cublas_gemm" in which:
        out["cublas_gemm"] = (lambda: torch.nn.functional.linear(x, w), None)
    if "eager" in which:
        out["eager"] = (post, post)
    for name, mode in (("inductor", None), ("inductor_max_autotune", "max-autotune-no-cudagraphs")):
        if name in which:
            compiled = _torch_compile(torch, lambda *a: _torch_postnorm(torch, *a, norm), mode=mode, dynamic=False)
            out[name] = (lambda c=compiled: c(*args), lambda c=compiled: c(*args))
    mod = workloads.post_norm(shape.M, shape.K, shape.N, dtype, norm, linear=True)
    for name, comfuse, hopper in (("tvm_dlight", False, None), ("comfuse_mma_sync", True, False), ("comfuse", True, None)):
        if name in which:
            out[name] = lambda m=mod, c=comfuse, h=hopper: _tvm_callable(torch, m, args, c, target, hopper=h)
    if "comfuse_hopper_all" in which:
        out["comfuse_hopper_all"] = lambda m=mod: _tvm_callable(torch, m, args, True, target, hopper_groups=HOPPER_GROUPS)
    if "tvm_metaschedule" in which:
        work_dir = None if vanilla_logs is None else os.path.join(vanilla_logs, f"{shape.name}-{norm}-{dtype}")
        out["tvm_metaschedule"] = lambda m=mod: _vanilla_tuned_callable(torch, m, args, target, work_dir=work_dir)
    logs = tuned_logs(shape.name)
    if "comfuse_tuned" in which and logs and (norm, dtype) == ("layer_norm", "float16"):  # what the logs were tuned for
        out["comfuse_tuned"] = lambda m=mod: _tvm_callable(torch, m, args, True, target, logs)
    return out


def tuned_logs(workload: str) -> str | None:
    """The shipped tuning logs of a suite shape or model, if any."""
    from .tune.logs import RECORD_FILE, default_work_dir  # pylint: disable=import-outside-toplevel
    from .target import parse_target  # pylint: disable=import-outside-toplevel

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, default_work_dir(parse_target(TUNED_TARGET), workload))
    return path if os.path.isfile(os.path.join(path, RECORD_FILE)) else None


def run(shapes, norms, dtypes, which=CONTENDERS, log=print, vanilla_logs: str | None = None) -> list:
    """Measure every (shape, norm, dtype, contender); return the rows. ``vanilla_logs``: where
    the vanilla MetaSchedule contender keeps its tuning logs, one directory a case
    (``<shape>-<norm>-<dtype>``; None: not kept)."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.from_device(tvm.cuda(0))
    rows = []
    for shape in shapes:
        for norm in norms:
            for dtype in dtypes:
                torch.manual_seed(0)
                tdt = getattr(torch, dtype)
                M, K, N = shape.M, shape.K, shape.N
                args = [
                    torch.randn(M, K, device="cuda", dtype=tdt),
                    torch.randn(N, K, device="cuda", dtype=tdt) / K**0.5,
                    *(torch.randn(N, device="cuda", dtype=tdt) for _ in range(1)),
                    torch.randn(M, N, device="cuda", dtype=tdt),
                    *(torch.randn(N, device="cuda", dtype=tdt) for _ in range(2)),
                ]
                ref = _torch_postnorm(torch, *[a.float() for a in args], norm)
                for name, entry in _contenders(torch, shape, norm, dtype, args, which, target, vanilla_logs).items():
                    row = Row(shape.name, M, K, N, norm, dtype, name)
                    if callable(entry):  # a TVM build: compile now, errors recorded like the others'
                        try:
                            entry = entry()
                        except Exception as err_:  # pylint: disable=broad-except
                            entry = (_raise(err_), None)
                    rows.append(_timed(torch, row, *entry, ref, TOLERANCE[dtype], log))
    return rows


#: Whole models (``comfuse bench --models``): name -> (hidden, layers, heads); HuggingFace BERT
#: encoders, and ``prenorm-4096``, a pre-norm residual stream at LLaMA-7B's width
#: (:func:`~tvm_comfuse.workloads.prenorm_stack`: each layer's output projection, its residual
#: add and the next RMSNorm; no heads).
MODELS = {"bert-base": (768, 12, 12), "bert-large": (1024, 24, 16), "prenorm-4096": (4096, 8, 0)}
#: fp16 encoder output against the fp32 PyTorch module (LayerNorm'd, O(1) values).
MODEL_TOLERANCE = 1e-1


def _timed(torch, row, fn, fn_out, ref, tol, log):
    """Check ``fn_out()`` against ``ref``, then time ``fn``; fill ``row`` (errors included)."""
    try:
        if fn_out is not None:
            err = float((fn_out().float() - ref).abs().max())
            row.max_abs_err = round(err, 5)
            if not err <= tol:
                raise ValueError(f"wrong result: max abs error {err:.3g}")
        row.wall_us = round(wall_us(torch, fn), 2)
        ku, nk, row.breakdown = kernel_us(torch, fn)
        row.kernel_us, row.kernels_per_call = round(ku, 2), round(nk, 2)
    except Exception as err_:  # pylint: disable=broad-except
        row.error = f"{type(err_).__name__}: {str(err_).splitlines()[0][:200] if str(err_) else ''}"
    log(json.dumps(asdict(row)))
    if isinstance(log, Checkpoint):
        log.record(row)
    return row


class Checkpoint:
    """A log for the bench's run functions that prints as ``print`` does and, as each row is
    measured, rewrites the results file ``path`` with every row so far: a run the device call's
    time limit cuts short keeps what it measured (session 24 lost a shape's rows that way, its
    vanilla MetaSchedule contender tuning when the call ended)."""

    def __init__(self, path: str, log=print):
        self.path, self.log, self.rows = path, log, []

    def __call__(self, *args, **kwargs):
        self.log(*args, **kwargs)

    def record(self, row: Row) -> None:
        self.rows.append(row)
        save(self.rows, self.path)


def _raise(err):
    def fn():
        raise err

    return fn


def _time_all(torch, names, row, torch_fns, mod, args, ref, target, log, logs=None) -> list:
    """Time each contender of ``names`` on one case: PyTorch's from ``torch_fns`` (name ->
    ``(run, run_and_return_output)``), the others by compiling ``mod`` (vanilla TVM's
    ``tvm_dlight``; ComFuse's default pipeline, with every Hopper kernel for
    ``comfuse_hopper_all``, or with the tuning logs ``logs`` for ``comfuse_tuned``, skipped
    without them) and running it on ``args``; ``row(name)`` is the case's empty Row."""
    rows = []
    for contender in names:
        if contender in torch_fns:
            rows.append(_timed(torch, row(contender), *torch_fns[contender], ref, TOLERANCE["float16"], log))
            continue
        if contender == "comfuse_tuned" and logs is None:
            continue
        try:
            groups = HOPPER_GROUPS if contender == "comfuse_hopper_all" else None
            fn, fn_out = _tvm_callable(torch, mod, args, contender != "tvm_dlight", target, logs if contender == "comfuse_tuned" else None,
                                       hopper_groups=groups)
        except Exception as err_:  # pylint: disable=broad-except
            fn, fn_out = _raise(err_), None
        rows.append(_timed(torch, row(contender), fn, fn_out, ref, TOLERANCE["float16"], log))
    return rows


#: Attention shapes of ``comfuse bench --attention SEQ...`` (issue 5): batch x heads 256, head dim 64.
ATTENTION_BATCH, ATTENTION_HEADS, ATTENTION_HEAD_DIM = 32, 8, 64


def run_attention(seqs, which=CONTENDERS, log=print) -> list:
    """Multi-head attention (``workloads.attention``, fp16) at each sequence length: eager
    (two batched GEMMs and a softmax), torch.compile, ``scaled_dot_product_attention``, vanilla
    TVM, ComFuse's default pipeline and ComFuse with its attention kernel (``comfuse_hopper_all``)."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.from_device(tvm.cuda(0))
    b, h, d, rows = ATTENTION_BATCH, ATTENTION_HEADS, ATTENTION_HEAD_DIM, []
    for s in seqs:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h * d, device="cuda", dtype=torch.float16) for _ in range(3))
        qh, kh, vh = (t.reshape(b, s, h, d).transpose(1, 2) for t in (q, k, v))
        ref = (torch.softmax(qh.float() @ kh.float().transpose(-1, -2) * 0.125, -1) @ vh.float()).transpose(1, 2).reshape(b * s, h * d)

        def eager(qh=qh, kh=kh, vh=vh, s=s):
            p = torch.softmax((qh @ kh.transpose(-1, -2) * 0.125).float(), -1).half()
            return (p @ vh).transpose(1, 2).reshape(b * s, h * d)

        contenders = {"eager": (eager, eager)}
        if "inductor" in which:
            compiled = _torch_compile(torch, eager, dynamic=False)
            contenders["inductor"] = (compiled, compiled)
        sdpa = lambda qh=qh, kh=kh, vh=vh, s=s: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(b * s, h * d)  # noqa: E731
        contenders["sdpa"] = (sdpa, sdpa)
        names = [c for c in ("eager", "inductor", "sdpa", "tvm_dlight", "comfuse", "comfuse_hopper_all") if c in which]
        row = lambda c, s=s: Row(f"attention-b{b}h{h}-s{s}", b * s, d, h * d, "attention", "float16", c)  # noqa: E731
        rows += _time_all(torch, names, row, contenders, workloads.attention(b, h, s, d), [q, k, v], ref, target, log)
    return rows


def run_mlp(widths, which=CONTENDERS, log=print) -> list:
    """Issue 5's MLP, ``gelu(x @ w1.T + b1) @ w2.T + b2`` (fp16, ``workloads.mlp``), at each
    intermediate width and each of :data:`workloads.MLP_TOKENS` tokens, model width
    :data:`workloads.MLP_WIDTH`: eager (two cuBLAS GEMMs with their bias epilogues and a GELU
    kernel), torch.compile, vanilla TVM, ComFuse's default pipeline (two GEMM kernels) and
    ComFuse with every Hopper kernel (``comfuse_hopper_all``: the pair as one b2b kernel), and
    ComFuse with the shipped logs of ``comfuse tune mlp-<tokens>-<N1>`` where they exist."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.from_device(tvm.cuda(0))
    f, d, rows = torch.nn.functional, workloads.MLP_WIDTH, []
    for m in workloads.MLP_TOKENS:
        for n1 in widths:
            torch.manual_seed(0)
            args = [torch.randn(m, d, device="cuda", dtype=torch.float16), torch.randn(n1, d, device="cuda", dtype=torch.float16) / d**0.5,
                    torch.randn(n1, device="cuda", dtype=torch.float16), torch.randn(d, n1, device="cuda", dtype=torch.float16) / n1**0.5,
                    torch.randn(d, device="cuda", dtype=torch.float16)]
            x, w1, b1, w2, b2 = args
            eager = lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: f.linear(f.gelu(f.linear(x, w1, b1)), w2, b2)  # noqa: E731
            ref = eager(*[a.float() for a in args])
            contenders = {"eager": (eager, eager)}
            if "inductor" in which:
                compiled = _torch_compile(torch, eager, dynamic=False)
                contenders["inductor"] = (compiled, compiled)
            names = [c for c in ("eager", "inductor", "tvm_dlight", "comfuse", "comfuse_tuned", "comfuse_hopper_all") if c in which]
            row = lambda c, m=m, n1=n1: Row(f"mlp-{m}x{d}-{n1}", m, d, d, f"mlp{n1}", "float16", c)  # noqa: E731
            rows += _time_all(torch, names, row, contenders, workloads.mlp(m, d, n1, d), args, ref, target, log,
                              tuned_logs(f"mlp-{m}-{n1}"))
    return rows


def run_model(name: str, batch: int, seq: int, which=CONTENDERS, log=print) -> list:
    """A model of :data:`MODELS` (random weights), fp16, end to end: PyTorch eager and torch.compile
    on ``module.half()``, vanilla TVM and ComFuse on its ``from_exported_program`` import, BERT's
    with fp16 inputs and weights (``half``: the graph PyTorch runs, on the same fp16 input;
    weights bound as constants, as a deployment would), checked against the float32 module.
    The pre-norm stack keeps mixed precision (float32 inputs): imported all fp16, its RMSNorm's
    arithmetic (a square in fp16, then a cast) is not folded into one norm (session 19)."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel

    hidden, layers, heads = MODELS[name]
    fp16_in = not name.startswith("prenorm")
    if not fp16_in:
        mod, params, module, example = workloads.prenorm_stack(layers=layers, batch=batch, seq=seq, width=hidden, dtype="float16")
    else:
        mod, params, module, example = workloads.bert_encoder(
            layers=layers, hidden=hidden, heads=heads, batch=batch, seq=seq, dtype="float16", half=True
        )
    names = [p.name for p in mod["main"].params[1:]]
    mod = relax.transform.BindParams("main", dict(zip(names, (tvm.runtime.tensor(p) for p in params))))(mod)
    target = tvm.target.Target.from_device(tvm.cuda(0))
    x = torch.randn_like(example).cuda()
    with torch.no_grad():
        ref = module.cuda()(x).float()
        half = module.half()
        xh = x.half()
        contenders = {
            "eager": (lambda: half(xh), lambda: half(xh)),
        }
        if "inductor" in which:
            compiled = _torch_compile(torch, half, dynamic=False)
            contenders["inductor"] = (lambda: compiled(xh), lambda: compiled(xh))
        rows = []
        shape = f"{name}-b{batch}-s{seq}"
        models = ("eager", "inductor", "tvm_dlight", "comfuse_mma_sync", "comfuse_tuned", "comfuse", "comfuse_hopper_all")
        for contender in [c for c in models if c in which]:
            row = Row(shape, batch * seq, hidden, hidden, "encoder", "float16", contender)
            if contender in contenders:
                rows.append(_timed(torch, row, *contenders[contender], ref, MODEL_TOLERANCE, log))
                continue
            logs = tuned_logs(name) if contender == "comfuse_tuned" else None
            if contender == "comfuse_tuned" and logs is None:
                continue
            try:
                hopper = False if contender == "comfuse_mma_sync" else None
                fn, fn_out = _tvm_callable(torch, mod, [xh if fp16_in else x], contender != "tvm_dlight", target, logs, hopper,
                                           hopper_groups=HOPPER_GROUPS if contender == "comfuse_hopper_all" else None)
            except Exception as err_:  # pylint: disable=broad-except
                fn, fn_out = _raise(err_), None
            rows.append(_timed(torch, row, fn, fn_out, ref, MODEL_TOLERANCE, log))
    return rows


def gpu_driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None without one: kernel times move with
    it, so results and notebooks record it beside the GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def environment() -> dict:
    """GPU, driver, versions, commit and date for the results file. ``COMFUSE_COMMIT`` wins over
    git: a copied working tree (the GPU machine's) can carry stale git metadata."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    try:
        commit = os.environ.get("COMFUSE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
        "driver": gpu_driver(),
        "torch": torch.__version__,
        "tvm": tvm.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def table(rows: list) -> str:
    """Device µs per contender (columns) per case (rows), with ComFuse's ratios."""
    cases, cols = {}, [c for c in CONTENDERS if any(r.contender == c for r in rows)]
    for r in rows:
        cases.setdefault((r.shape, r.norm, r.dtype), {})[r.contender] = r
    head = f"{'case':<38}" + "".join(f"{c[:14]:>15}" for c in cols) + f"{'vs dlight':>10}{'vs cublas':>10}"
    lines = [head]
    for (shape, norm, dtype), by in cases.items():
        cells = []
        for c in cols:
            r = by.get(c)
            cells.append(f"{'-' if r is None else 'ERR' if r.kernel_us is None else f'{r.kernel_us:.1f}':>15}")
        ours, dl, cb = (by.get(c) for c in ("comfuse", "tvm_dlight", "cublas_gemm"))
        ratio = lambda a, b: f"{a.kernel_us / b.kernel_us:.2f}x" if a and b and a.kernel_us and b.kernel_us else "-"  # noqa: E731
        lines.append(f"{shape + ' ' + norm + ' ' + dtype:<38}" + "".join(cells) + f"{ratio(dl, ours):>10}{ratio(ours, cb):>10}")
    return "\n".join(lines)


def save(rows: list, path: str) -> None:
    """Write rows and the environment as JSON."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"environment": environment(), "units": "microseconds per call", "rows": [asdict(r) for r in rows]}, f, indent=1)

