"""Workloads: the Relax graphs ComFuse is built for, with references to check them against.

``post_norm`` builds ``norm(act(x @ w + b) + r)`` in the forms models use (LayerNorm,
RMSNorm, softmax, their decomposed versions, PyTorch's ``linear`` weight layout, 3-D
activations); ``attention`` a multi-head attention and ``mlp`` two linears around an
activation, as PyTorch exports them. ``bert_encoder`` exports a HuggingFace BERT encoder
(random weights, built from a config: no download) with ``torch.export`` and imports it with
TVM's PyTorch frontend; ``mlp_encoder`` does the same for a PyTorch MLP block. ``SUITE`` holds
the benchmark shapes measured on the H200.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

NORMS = ("layer_norm", "rms_norm", "softmax", "layer_norm_decomposed", "rms_norm_decomposed")
EPS = 1e-5


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: ``norm(x[M,K] @ w[K,N] + b + r)``."""

    name: str
    M: int
    K: int
    N: int


#: The post-norm suite (BERT/GPT projections feeding a LayerNorm), as in ../shared/anchors.
SUITE = (
    Shape("bert-base-attnout", 4096, 768, 768),
    Shape("bert-base-ffn2", 4096, 3072, 768),
    Shape("bert-large-ffn2", 4096, 4096, 1024),
    Shape("gpt-4k-proj", 8192, 4096, 4096),
    Shape("wide-short-k", 16384, 256, 1024),
)


def _norm(bb: relax.BlockBuilder, y, norm: str, gamma, beta, n: int):
    """Emit ``norm`` of ``y`` over its last axis."""
    op = relax.op
    if norm == "layer_norm":
        return bb.emit(op.nn.layer_norm(y, gamma, beta, axes=[-1], epsilon=EPS))
    if norm == "rms_norm":
        return bb.emit(op.nn.rms_norm(y, gamma, axes=[-1], epsilon=EPS))
    if norm == "softmax":
        return bb.emit(op.nn.softmax(y, axis=-1))
    dtype = str(y.ty.dtype)
    eps = relax.const(EPS, dtype)
    if norm == "layer_norm_decomposed":
        mean = bb.emit(op.mean(y, axis=[-1], keepdims=True))
        centered = bb.emit(op.subtract(y, mean))
        var = bb.emit(op.mean(bb.emit(op.multiply(centered, centered)), axis=[-1], keepdims=True))
        inv = bb.emit(op.rsqrt(bb.emit(op.add(var, eps))))
        return bb.emit(op.add(bb.emit(op.multiply(bb.emit(op.multiply(centered, inv)), gamma)), beta))
    if norm == "rms_norm_decomposed":  # as HuggingFace's LlamaRMSNorm: in float32, cast back
        h = bb.emit(op.astype(y, "float32"))
        ms = bb.emit(op.mean(bb.emit(op.power(h, relax.const(2.0, "float32"))), axis=[-1], keepdims=True))
        inv = bb.emit(op.rsqrt(bb.emit(op.add(ms, relax.const(EPS, "float32")))))
        return bb.emit(op.multiply(bb.emit(op.astype(bb.emit(op.multiply(h, inv)), dtype)), gamma))
    raise ValueError(f"unknown norm {norm!r}; choose from {NORMS}")


def post_norm(
    M: int,
    K: int,
    N: int,
    dtype: str = "float32",
    norm: str = "layer_norm",
    *,
    linear: bool = False,
    batch: int | None = None,
    act: str | None = None,
    residual_out: bool = False,
    out_act: str | None = None,
) -> tvm.IRModule:
    """``out = out_act(norm(act(x @ w + b) + r))`` as a Relax module named ``main``.

    ``linear`` stores the weight as ``[N, K]`` and multiplies by ``permute_dims(w)`` (how
    PyTorch's linear imports); ``batch`` makes ``x`` and ``r`` 3-D ``[batch, M, K]``;
    ``residual_out`` also returns the residual sum (a second output of the group).
    """
    rows = (batch, M) if batch else (M,)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*rows, K), dtype))
    w = relax.Var("w", relax.TensorType((N, K) if linear else (K, N), dtype))
    b = relax.Var("b", relax.TensorType((N,), dtype))
    r = relax.Var("r", relax.TensorType((*rows, N), dtype))
    gamma = relax.Var("gamma", relax.TensorType((N,), dtype))
    beta = relax.Var("beta", relax.TensorType((N,), dtype))
    params = [x, w, b, r, gamma, beta]
    with bb.function("main", params):
        with bb.dataflow():
            wk = bb.emit(relax.op.permute_dims(w)) if linear else w
            y = bb.emit(relax.op.matmul(x, wk))
            y = bb.emit(relax.op.add(y, b))
            if act:
                y = bb.emit(getattr(relax.op.nn, act)(y))
            s = bb.emit(relax.op.add(y, r))
            out = _norm(bb, s, norm, gamma, beta, N)
            if out_act:
                out = bb.emit(getattr(relax.op.nn, out_act)(out))
            result = bb.emit_output(relax.Tuple([out, s]) if residual_out else out)
        bb.emit_func_output(result)
    return bb.get()


def post_norm_reference(args: list, norm: str, *, linear=False, act=None, residual_out=False, out_act=None):
    """NumPy float64 reference of :func:`post_norm` for inputs ``[x, w, b, r, gamma, beta]``."""
    x, w, b, r, gamma, beta = (np.asarray(a, dtype=np.float64) for a in args)
    y = x @ (w.T if linear else w) + b
    y = _np_act(act, y)
    s = y + r
    base = norm.replace("_decomposed", "")
    if base == "layer_norm":
        mu = s.mean(-1, keepdims=True)
        out = (s - mu) / np.sqrt(((s - mu) ** 2).mean(-1, keepdims=True) + EPS) * gamma + beta
    elif base == "rms_norm":
        out = s / np.sqrt((s**2).mean(-1, keepdims=True) + EPS) * gamma
    else:
        e = np.exp(s - s.max(-1, keepdims=True))
        out = e / e.sum(-1, keepdims=True)
    out = _np_act(out_act, out)
    return [out, s] if residual_out else [out]


def _np_act(act, v):
    if act is None:
        return v
    if act == "relu":
        return np.maximum(v, 0)
    if act == "silu":
        return v / (1 + np.exp(-v))
    if act == "gelu":
        return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))
    raise ValueError(f"no reference for activation {act!r}")


def random_inputs(mod: tvm.IRModule, seed: int = 0, scale: float = 1.0) -> list:
    """Fresh random arrays (float32 storage) for every parameter of ``mod["main"]``.

    Weights-like 2-D tensors are scaled by 1/sqrt(K) so fp16 results stay in range.
    """
    rng = np.random.default_rng(seed)
    out = []
    for p in mod["main"].params:
        shape = [int(d) for d in p.ty.shape.values]
        a = rng.standard_normal(shape) * scale
        if p.name == "w":
            a /= np.sqrt(max(shape))
        out.append(a.astype("float32"))
    return out


def attention(b: int, h: int, s: int, d: int = 64, dtype: str = "float16", scale_op: str = "multiply",
              extra_output: bool = False, mask: bool = False) -> tvm.IRModule:
    """Multi-head attention as PyTorch exports it, ``main(q, k, v[, mask])`` on ``[B, S, H * D]``:
    heads split (``reshape``, ``permute_dims``), ``softmax(q @ k.T * 1/8 (+ mask))`` (or ``/ 8``)
    with the scores in ``dtype`` and the softmax in float32 (the padding ``mask``, ``[B, 1, 1,
    S]`` float32, added there, as HuggingFace encoders add it), ``@ v``, heads merged to ``[B *
    S, H * D]``; ``extra_output`` also returns the probabilities."""
    bb = relax.BlockBuilder()
    ins = [relax.Var(n, relax.TensorType((b, s, h * d), dtype)) for n in "qkv"]
    ins += [relax.Var("mask", relax.TensorType((b, 1, 1, s), "float32"))] if mask else []
    with bb.function("main", ins):
        with bb.dataflow():
            heads = [bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(x, (b, s, h, d))), [0, 2, 1, 3])) for x in ins[:3]]
            q, k, v = (bb.emit(relax.op.reshape(x, (b * h, s, d))) for x in heads)
            scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 2, 1])), out_dtype=dtype))
            scores = bb.emit(relax.op.reshape(scores, (b, h, s, s)))
            const = relax.const(0.125 if scale_op == "multiply" else 8.0, dtype)
            scaled = bb.emit(relax.op.multiply(scores, const) if scale_op == "multiply" else relax.op.divide(scores, const))
            scores32 = bb.emit(relax.op.astype(scaled, "float32"))
            scores32 = bb.emit(relax.op.add(scores32, ins[3])) if mask else scores32
            p32 = bb.emit(relax.op.nn.softmax(scores32, axis=-1))
            p = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(p32, dtype)), (b * h, s, s)))
            ctx = bb.emit(relax.op.matmul(p, v, out_dtype=dtype))
            merged = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(ctx, (b, h, s, d))), [0, 2, 1, 3]))
            merged = bb.emit(relax.op.reshape(merged, (b * s, h * d)))
            out = bb.emit_output(relax.Tuple([merged, p32]) if extra_output else merged)
        bb.emit_func_output(out)
    return bb.get()


#: Issue 5's MLP shapes (``comfuse bench --mlp N1...``): tokens x model width, the width of the
#: narrow intermediate varying.
MLP_TOKENS, MLP_WIDTH = (16384, 65536), 1024


def mlp(M: int, K: int, N1: int, N2: int | None = None, dtype: str = "float16", act: str | None = "gelu", *,
        batch: int | None = None, bias2: bool = True, residual: bool = False) -> tvm.IRModule:
    """``act(x @ w1.T + b1) @ w2.T (+ b2) (+ r)``, two PyTorch ``nn.Linear`` layers (weights
    ``[N, K]``) around an activation, as ``main(x, w1, b1, w2[, b2][, r])``; ``batch`` makes the
    activations 3-D ``[batch, M, ...]``. ComFuse's back-to-back GEMM pattern (issue 5) when the
    intermediate ``N1`` is narrow."""
    N2 = N2 or K
    rows = (batch, M) if batch else (M,)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*rows, K), dtype))
    w1 = relax.Var("w1", relax.TensorType((N1, K), dtype))
    b1 = relax.Var("b1", relax.TensorType((N1,), dtype))
    w2 = relax.Var("w2", relax.TensorType((N2, N1), dtype))
    params = [x, w1, b1, w2]
    params += [relax.Var("b2", relax.TensorType((N2,), dtype))] if bias2 else []
    params += [relax.Var("r", relax.TensorType((*rows, N2), dtype))] if residual else []
    with bb.function("main", params):
        with bb.dataflow():
            h = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w1)))), b1))
            h = bb.emit(getattr(relax.op.nn, act)(h)) if act else h
            y = bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w2))))
            for p in params[4:]:
                y = bb.emit(relax.op.add(y, p))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def mlp_reference(args: list, act: str | None = "gelu"):
    """NumPy float64 reference of :func:`mlp` for its inputs ``[x, w1, b1, w2, *added]``."""
    x, w1, b1, w2, *added = (np.asarray(a, dtype=np.float64) for a in args)
    y = _np_act(act, x @ w1.T + b1) @ w2.T
    for a in added:
        y = y + a
    return y


def bert_encoder(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    intermediate: int | None = None,
    batch: int = 2,
    seq: int = 16,
    dtype: str = "float32",
    seed: int = 0,
    half: bool = False,
):
    """A HuggingFace BERT encoder (random weights, no download) imported into Relax.

    Returns ``(mod, params, torch_module, example_input)``: ``mod["main"]`` takes the hidden
    states followed by ``params`` (``keep_params_as_input``), as TVM's frontend imports it,
    both float32; with ``dtype="float16"`` the graph computes in fp16 (TVM's mixed precision:
    the GEMMs in fp16, the norms and the residual stream in float32). With ``half`` too, the
    hidden states and the weights are fp16 as well (``params`` converted), so every op computes
    in fp16: the graph PyTorch runs after ``module.half()`` (:func:`_imported`).
    Needs ``torch`` and ``transformers`` (the ``test`` extra).
    """
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import BertConfig, BertModel  # pylint: disable=import-outside-toplevel

    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate or 4 * hidden,
        vocab_size=128,
        max_position_embeddings=max(seq, 64),
        attn_implementation="eager",
    )
    model = BertModel(config, add_pooling_layer=False).eval()

    class Encoder(torch.nn.Module):  # the encoder stack alone: hidden states in and out
        def __init__(self, bert):
            super().__init__()
            self.encoder = bert.encoder

        def forward(self, hidden_states):
            return self.encoder(hidden_states)[0]

    module = Encoder(model).eval()
    return _imported(module, torch.randn(batch, seq, hidden), dtype, half)


def _imported(module, example, dtype: str, half: bool = False):
    """``(mod, params, module, example)``: ``module`` exported with ``torch.export`` on
    ``example`` and imported with TVM's PyTorch frontend, computing in ``dtype``; with
    ``half``, ``main``'s inputs and weights are fp16 too (``params`` converted; ``example``
    stays float32: cast it to feed the module).

    Why ``half``: under mixed precision alone the inputs and weights stay float32, and with
    them every op that follows them (the bias and residual adds, LayerNorm, the residual
    stream), so a post-norm group reads and writes float32 rows; PyTorch's ``module.half()``,
    what the benchmark compares against, moves fp16 rows. At BERT-large (H200, session 19) the
    attention output's post-norm took 35 us a layer that way, against 19 for the same fp16
    block in the suite."""
    import torch  # pylint: disable=import-outside-toplevel
    from tvm.relax.frontend.torch import from_exported_program  # pylint: disable=import-outside-toplevel

    if half and dtype != "float16":
        raise ValueError(f"half=True with dtype={dtype!r}: TVM's mixed-precision pass makes inputs and weights float16 only; "
                         "pass dtype='float16'")
    with torch.no_grad():
        exported = torch.export.export(module, (example,))
    mod = from_exported_program(exported, keep_params_as_input=True)
    if dtype != "float32":
        # TVM 0.27's importer cannot take a half-precision addmm (it emits an fp32 matmul
        # next to an fp16 bias), so import in fp32 and let TVM's mixed-precision pass
        # compute in ``dtype`` with fp32 accumulation; inputs and params stay fp32 unless ``half``.
        names = [p.name for p in mod["main"].params] if half else None
        mod = relax.transform.ToMixedPrecision(out_dtype=dtype, fp16_input_names=names)(mod)
    mod, params = relax.frontend.detach_params(mod)
    return mod, [p.numpy().astype(dtype) if half else p.numpy() for p in params["main"]], module, example


def prenorm_stack(layers: int = 2, batch: int = 2, seq: int = 64, width: int = 256, dtype: str = "float16", seed: int = 0):
    """The residual stream of a pre-norm transformer as LLaMA-style PyTorch models write it, its
    sublayers reduced to their output projections: ``n = RMSNorm(x); h = x`` then, per layer,
    ``h = h + proj(n); n = RMSNorm(h)``; returns ``n`` (``torch.nn.RMSNorm``, bias-less
    ``nn.Linear``, random weights), exported and imported as :func:`bert_encoder` is. Every
    projection but the last feeds a group that keeps the stream ``h`` beside its norm, which
    arrives written out as arithmetic. Returns ``(mod, params, torch_module, example_input)``."""
    import torch  # pylint: disable=import-outside-toplevel

    torch.manual_seed(seed)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(width, eps=1e-5) for _ in range(layers + 1))
            self.projs = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

        def forward(self, x):
            h, n = x, self.norms[0](x)
            for proj, norm in zip(self.projs, self.norms[1:]):
                h = h + proj(n)
                n = norm(h)
            return n

    return _imported(Stack().eval(), torch.randn(batch, seq, width), dtype)


def mlp_encoder(batch: int = 2, seq: int = 100, width: int = 256, intermediate: int = 128, act: str = "gelu",
                residual: bool = True, dtype: str = "float16", seed: int = 0):
    """A PyTorch MLP block, ``fc2(act(fc1(x))) (+ x)`` on ``[batch, seq, width]`` (random weights),
    exported and imported as :func:`bert_encoder` is: what the back-to-back GEMM pass meets in
    a real model (3-D rows regrouped around each linear, fp32 biases and residual under mixed
    precision). Returns ``(mod, params, torch_module, example_input)``."""
    import torch  # pylint: disable=import-outside-toplevel

    torch.manual_seed(seed)
    fc1, fc2, fn = torch.nn.Linear(width, intermediate), torch.nn.Linear(intermediate, width), getattr(torch.nn.functional, act)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = fc1, fc2

        def forward(self, x):
            y = self.fc2(fn(self.fc1(x)))
            return y + x if residual else y

    return _imported(MLP().eval(), torch.randn(batch, seq, width), dtype)
