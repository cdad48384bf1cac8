"""Named workloads for ``comfuse tune``, and Relax modules read from TVMScript files.

The names are what users tune for: the post-norm suite (the shapes ``comfuse bench``
measures), issue 5's MLPs (``mlp-<tokens>-<intermediate>``, ``comfuse bench --mlp``), BERT
base/large encoders with their real hidden sizes and depths, and tiny CPU-sized modules that
tune in seconds (CI, smoke tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import tvm

from .. import workloads
from ..errors import ComFuseError, check_module

#: (hidden, layers, heads) of the real BERT configurations.
BERT_CONFIGS = {"bert-base": (768, 12, 12), "bert-large": (1024, 24, 16)}


@dataclass(frozen=True)
class Workload:
    """A named workload: ``build(layers)`` returns the Relax module (``layers`` may be None)."""

    name: str
    description: str
    build: Callable[[int | None], tvm.IRModule]


def _post_norm(shape: workloads.Shape) -> Workload:
    return Workload(
        shape.name,
        f"LayerNorm(x[{shape.M},{shape.K}] @ w.T + b + r), fp16",
        lambda _layers: workloads.post_norm(shape.M, shape.K, shape.N, "float16", "layer_norm", linear=True),
    )


def _bert(name: str) -> Workload:
    hidden, layers, heads = BERT_CONFIGS[name]

    def build(n_layers):
        mod, *_ = workloads.bert_encoder(
            layers=n_layers or layers, hidden=hidden, heads=heads, batch=32, seq=128, dtype="float16", half=True
        )
        return mod

    return Workload(
        name, f"HuggingFace BERT encoder, fp16 (inputs and weights too), batch 32 x sequence 128, hidden {hidden}, {layers} layers (--layers shrinks it)", build
    )


def _mlp(m: int, n1: int) -> Workload:
    d = workloads.MLP_WIDTH
    return Workload(f"mlp-{m}-{n1}", f"gelu(x[{m},{d}] @ w1.T + b1) @ w2.T + b2 through {n1} columns, fp16 "
                    "(tune with --hopper-groups ... b2b for the back-to-back kernel)", lambda _layers: workloads.mlp(m, d, n1, d))


def _tiny(name, desc, M, K, N, norm, **kw) -> Workload:
    return Workload(name, desc, lambda _layers: workloads.post_norm(M, K, N, "float32", norm, linear=True, **kw))


def _tiny_bert(n_layers):
    mod, *_ = workloads.bert_encoder(layers=n_layers or 1, hidden=32, heads=2, batch=1, seq=8)
    return mod


WORKLOADS = {
    w.name: w
    for w in (
        [_post_norm(s) for s in workloads.SUITE]
        + [_mlp(m, n1) for m in workloads.MLP_TOKENS for n1 in (64, 128, 256)]
        + [_bert(n) for n in BERT_CONFIGS]
        + [
            _tiny("tiny-postnorm", "LayerNorm(x[64,32] @ w.T + b + r), fp32: CPU smoke test", 64, 32, 48, "layer_norm"),
            _tiny("tiny-rmsnorm", "RMSNorm(gelu(x[32,16] @ w.T + b) + r), fp32", 32, 16, 32, "rms_norm", act="gelu"),
            Workload("tiny-bert", "BERT encoder, hidden 32, 1 layer, seq 8 (needs torch)", _tiny_bert),
        ]
    )
}


def load_workload(name_or_path: str, layers: int | None = None) -> tuple[str, tvm.IRModule]:
    """``(name, module)`` for a registered name or a file holding a Relax IRModule as TVMScript.

    The name of a file workload is its stem; it names the default work directory.
    """
    if name_or_path in WORKLOADS:
        return name_or_path, WORKLOADS[name_or_path].build(layers)
    if os.path.isfile(name_or_path):
        return _stem(name_or_path), _parse_file(name_or_path)
    raise ComFuseError(
        f"unknown workload {name_or_path!r} (not a registered name, and no such file). "
        f"Known workloads: {', '.join(WORKLOADS)}; or pass the path of a TVMScript file "
        "holding a Relax IRModule (the output of mod.script())."
    )


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _parse_file(path: str) -> tvm.IRModule:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        mod = tvm.script.from_source(source)
    except Exception as err:  # the parser raises DiagnosticError/TVMError with a long render
        first = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise ComFuseError(f"{path}: not a TVMScript IRModule ({first.strip()})") from None
    check_module(mod, path)
    return mod
