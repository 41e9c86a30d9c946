"""JAX's own Triton kernel library (``jax.experimental.pallas.ops.gpu``) on this project.

Every Triton kernel of the installed JAX (flash attention forward and its ``custom_vjp``
backward, decode attention in its MQA/GQA and ragged forms, paged attention, layer norm and
RMS norm forward and backward, softmax) is loaded through ``porting.ported``: JAX's source with
only its Pallas imports pointing at ``pallas_core`` and ``pallas_triton``. The kernels pass
``pallas_triton.CompilerParams`` together with ``interpret=True``, so they run on this
project's interpreter on CPU; each is compared with the reference implementation shipped in the
same JAX module, on random inputs (backward: ``jax.vjp`` of the kernel against ``jax.vjp`` of the
reference). The Mosaic GPU kernels (``*_mgpu.py``) are not covered here.

The same kernels are also lowered for ``cuda`` and for ``rocm`` by the Triton backend, and
compiled by the ``triton`` package (where installed) to cubins for ``sm_80`` and ``sm_90`` and to
an hsaco for ``gfx942``, through ``pl.stages`` (no GPU needed; about 10 s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_core.reference import sub_jaxprs
from pallas_core.stages import kernel_calls
from tests.jax_library import porting

attention = porting.ported("gpu.attention")
decode_attention = porting.ported("gpu.decode_attention")
paged_attention = porting.ported("gpu.paged_attention")
layer_norm = porting.ported("gpu.layer_norm")
rms_norm = porting.ported("gpu.rms_norm")
softmax = porting.ported("gpu.softmax")

F32 = jnp.float32


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _primitive_names(jaxpr: Any) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for sub in sub_jaxprs(eqn.params):
                names += _primitive_names(sub)
    return names


def _assert_ours(fn: Callable[..., Any], *args: Any) -> None:
    """Every kernel ``fn(*args)`` runs is a ``pallas_core`` kernel on the interpreter, none
    JAX's own ``pallas_call`` (which a half-ported module would reach)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    calls = list(kernel_calls(jaxpr))
    assert calls, "no pallas_core kernel was traced"
    assert {c.backend for c in calls} == {"interpret"}
    assert _primitive_names(jaxpr).count("pallas_call") == len(calls)


def _assert_trees_close(got: Any, want: Any, same_dtype: bool = True, **tol: float) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape, (g.shape, w.shape)
        assert g.dtype == w.dtype or not same_dtype, (g.dtype, w.dtype)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)


# --- attention.py: mha forward and backward ---------------------------------------------------

BLOCKS = attention.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                              block_q_dq=16, block_kv_dq=16)
CAUSAL_SEGMENTS = [(False, False), (False, True), (True, False), (True, True)]


def _mha_inputs(head_dim: int, dtype: Any = F32, seq: int = 32, segments: bool = False
                ) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
    shape = (2, seq, 2, head_dim)
    qkv = tuple(_normal(s, shape, dtype) for s in range(3))
    # Three segments of uneven lengths, different in each batch row.
    seg = np.stack([np.repeat(np.arange(3), [5, 17, seq - 22]),
                    np.repeat(np.arange(3), [12, 12, seq - 24])])
    return qkv, (jnp.asarray(seg, jnp.int32) if segments else None)


@pytest.mark.parametrize("causal,segments", CAUSAL_SEGMENTS)
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: blocks padded to 32, masked by the kernel
def test_mha_forward(causal: bool, segments: bool, head_dim: int) -> None:
    (q, k, v), seg = _mha_inputs(head_dim, segments=segments)
    fn = functools.partial(attention.mha, segment_ids=seg, causal=causal, sm_scale=0.3,
                           block_sizes=BLOCKS, interpret=True)
    _assert_ours(fn, q, k, v)
    want = attention.mha_reference(q, k, v, seg, causal=causal, sm_scale=0.3)
    _assert_trees_close(fn(q, k, v), want, atol=2e-5, rtol=1e-5)


def test_mha_forward_float16_with_residuals() -> None:
    (q, k, v), seg = _mha_inputs(32, jnp.float16, seq=64, segments=True)
    out, lse = attention.mha(q, k, v, seg, causal=True, block_sizes=BLOCKS, interpret=True,
                             return_residuals=True)
    want = attention.mha_reference(q, k, v, seg, causal=True)  # float32
    assert out.dtype == jnp.float16
    _assert_trees_close(out, want, same_dtype=False, atol=2e-2)
    # The residual: log-sum-exp of each query's masked logits, in base 2 (the kernel works
    # with exp2), [batch, heads, q_len].
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32), k.astype(F32))
    pos = jnp.arange(q.shape[1])
    mask = (seg[:, None, :, None] == seg[:, None, None, :]) & (pos[:, None] >= pos[None, :])
    want_lse = jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1) / np.log(2)
    np.testing.assert_allclose(lse, want_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("causal,segments", CAUSAL_SEGMENTS)
def test_mha_backward(causal: bool, segments: bool) -> None:
    (q, k, v), seg = _mha_inputs(24, segments=segments)
    fn = functools.partial(attention.mha, segment_ids=seg, causal=causal, sm_scale=0.5,
                           block_sizes=BLOCKS, interpret=True)
    ref = functools.partial(attention.mha_reference, segment_ids=seg, causal=causal,
                            sm_scale=0.5)
    do = _normal(7, q.shape)
    grads = jax.jit(lambda *a: jax.vjp(fn, *a)[1](do))
    _assert_ours(grads, q, k, v)
    _assert_trees_close(grads(q, k, v), jax.vjp(ref, q, k, v)[1](do), atol=1e-4, rtol=1e-4)


def test_mha_backward_through_grad_with_uneven_blocks() -> None:
    """``jax.grad`` of a loss; the dKV and dQ passes use different block sizes."""
    (q, k, v), _ = _mha_inputs(16, seq=64)
    blocks = attention.BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_kv_dkv=32,
                                  block_q_dq=32, block_kv_dq=16)

    def loss(attn: Callable[..., jax.Array], *a: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(attn(*a)))

    fn = functools.partial(attention.mha, segment_ids=None, causal=True, block_sizes=blocks,
                           interpret=True)
    ref = functools.partial(attention.mha_reference, segment_ids=None, causal=True)
    got = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    _assert_trees_close(got, want, atol=1e-4, rtol=1e-4)


# --- decode_attention.py: mqa and gqa, with start / end positions ----------------------------

RAGGED_FORMS = {
    "full": (None, None),
    "start_scalar": (9, None),
    "end_per_row": (None, np.array([40, 61], np.int32)),
    "start_and_end_per_row": (np.array([3, 20], np.int32), np.array([37, 64], np.int32)),
}


@pytest.mark.parametrize("residuals", [False, True])
@pytest.mark.parametrize("form", list(RAGGED_FORMS))
def test_mqa(form: str, residuals: bool) -> None:
    start, end = (None if a is None else jnp.asarray(a) for a in RAGGED_FORMS[form])
    q, k, v = _normal(0, (2, 4, 32)), _normal(1, (2, 64, 32)), _normal(2, (2, 64, 32))
    kw = dict(start_idx=start, kv_seq_len=end, return_residuals=residuals,
              normalize_output=not residuals)
    fn = functools.partial(decode_attention.mqa, block_h=16, block_k=16, k_splits=2,
                           interpret=True, **kw)
    _assert_ours(fn, q, k, v)
    want = decode_attention.mqa_reference(q, k, v, **kw)
    _assert_trees_close(fn(q, k, v), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("residuals", [False, True])
@pytest.mark.parametrize("form", ["full", "start_and_end_per_row"])
def test_gqa(form: str, residuals: bool) -> None:
    start, end = (None if a is None else jnp.asarray(a) for a in RAGGED_FORMS[form])
    # 2 KV heads, 6 query heads each: the kernel's 16-row head blocks are masked.
    q, k, v = _normal(0, (2, 12, 16)), _normal(1, (2, 64, 2, 16)), _normal(2, (2, 64, 2, 16))
    kw = dict(start_idx=start, kv_seq_len=end, return_residuals=residuals,
              normalize_output=not residuals)
    fn = functools.partial(decode_attention.gqa, block_h=16, block_k=16, k_splits=4,
                           interpret=True, **kw)
    _assert_ours(fn, q, k, v)
    want = decode_attention.gqa_reference(q, k, v, **kw)
    _assert_trees_close(fn(q, k, v), want, atol=2e-5, rtol=2e-5)


def test_mqa_float16_with_defaults() -> None:
    q = _normal(0, (1, 2, 64), jnp.float16)
    k, v = _normal(1, (1, 512, 64), jnp.float16), _normal(2, (1, 512, 64), jnp.float16)
    got = decode_attention.mqa(q, k, v, kv_seq_len=jnp.array([300]), interpret=True)
    want = decode_attention.mqa_reference(q, k, v, kv_seq_len=jnp.array([300]))
    # The kernel's output is float32 (its final division adds a float32 epsilon), as in JAX.
    _assert_trees_close(got, want, same_dtype=False, atol=2e-3)


# --- paged_attention.py ------------------------------------------------------------------------

PAGE, PAGES_PER_SEQ, KV_HEADS, HEAD_DIM, BATCH = 4, 8, 2, 16, 3


def _paged_inputs(q_per_kv: int) -> tuple[jax.Array, ...]:
    pages = BATCH * PAGES_PER_SEQ
    k_pages = _normal(0, (KV_HEADS, pages, PAGE, HEAD_DIM))
    v_pages = _normal(1, (KV_HEADS, pages, PAGE, HEAD_DIM))
    tables = jax.random.permutation(jax.random.key(2), jnp.arange(pages, dtype=jnp.int32))
    q = _normal(3, (BATCH, KV_HEADS * q_per_kv, HEAD_DIM))
    return q, k_pages, v_pages, tables.reshape(BATCH, PAGES_PER_SEQ)


def _unpage(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """[kv_heads, pages, page, d] through the block tables -> [batch, seq, kv_heads, d]."""
    per_seq = pages[:, tables]  # [kv_heads, batch, pages_per_seq, page, d]
    seq = per_seq.reshape(KV_HEADS, BATCH, PAGES_PER_SEQ * PAGE, HEAD_DIM)
    return jnp.transpose(seq, (1, 2, 0, 3))


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    return jnp.round(x / scale[..., None]).astype(jnp.int8), scale


@pytest.mark.parametrize("variant", ["lengths", "no_lengths", "soft_cap", "quantized_k",
                                     "quantized_kv"])
def test_paged_attention(variant: str) -> None:
    q, k_pages, v_pages, tables = _paged_inputs(q_per_kv=6)
    lengths = None if variant == "no_lengths" else jnp.array([3, 17, 32], jnp.int32)
    cap = 2.0 if variant == "soft_cap" else None
    k_scales = v_scales = None
    if variant.startswith("quantized"):
        k_pages, k_scales = _quantize(k_pages)
        if variant == "quantized_kv":
            v_pages, v_scales = _quantize(v_pages)
    fn = functools.partial(paged_attention.paged_attention, block_h=16,
                           pages_per_compute_block=2, k_splits=2, attn_logits_soft_cap=cap,
                           interpret=True)
    args = (q, k_pages, v_pages, tables, lengths, k_scales, v_scales)
    _assert_ours(fn, *args)
    k = k_pages if k_scales is None else k_pages * k_scales[..., None]
    v = v_pages if v_scales is None else v_pages * v_scales[..., None]
    ref_lengths = jnp.full((BATCH,), PAGES_PER_SEQ * PAGE, jnp.int32) if lengths is None \
        else lengths
    want = paged_attention.paged_attention_reference(
        q, _unpage(k.astype(F32), tables), _unpage(v.astype(F32), tables), ref_lengths,
        attn_logits_soft_cap=cap)
    _assert_trees_close(fn(*args), want, atol=5e-5, rtol=5e-5)


# --- layer_norm.py and rms_norm.py: forward and backward --------------------------------------

NORMS = {"layer_norm": (layer_norm.layer_norm, layer_norm.layer_norm_reference),
         "rms_norm": (rms_norm.rms_norm, rms_norm.rms_norm_reference)}
# (2, 9, 40): 18 rows (the dW/dB kernel's 16-row blocks are masked), 40 features (blocks of 128
# and of 16 columns, masked); (1, 4, 256): no masking.
NORM_SHAPES = [(2, 9, 40), (1, 4, 256)]


def _norm_inputs(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _normal(0, shape), _normal(1, shape[-1:]), _normal(2, shape[-1:])


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_forward(norm: str, shape: tuple[int, ...]) -> None:
    fn, ref = NORMS[norm]
    x, w, b = _norm_inputs(shape)
    kernel = functools.partial(fn, interpret=True)
    _assert_ours(kernel, x, w, b)
    _assert_trees_close(kernel(x, w, b), ref(x, w, b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_backward(norm: str, shape: tuple[int, ...]) -> None:
    fn, ref = NORMS[norm]
    x, w, b = _norm_inputs(shape)
    do = _normal(3, shape)
    kernel = functools.partial(fn, interpret=True)
    grads = jax.jit(lambda *a: jax.vjp(kernel, *a)[1](do))
    _assert_ours(grads, x, w, b)
    _assert_trees_close(grads(x, w, b), jax.vjp(ref, x, w, b)[1](do), atol=1e-4, rtol=1e-4)


# --- softmax.py ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dtype,tol", [((8, 100), F32, 1e-6), ((2, 3, 33), F32, 1e-6),
                                             ((4, 128), jnp.bfloat16, 1e-2)])
def test_softmax(shape: tuple[int, ...], dtype: Any, tol: float) -> None:
    x = _normal(0, shape, dtype) * 3
    fn = functools.partial(softmax.softmax, axis=-1, interpret=True)
    _assert_ours(fn, x)
    _assert_trees_close(fn(x), jax.nn.softmax(x, axis=-1), atol=tol, rtol=tol)


# --- lowered for cuda by the Triton backend -----------------------------------------------------

_S = jax.ShapeDtypeStruct
_F16 = jnp.float16
_MHA = (_S((1, 32, 2, 24), _F16),) * 3
_NORM = (_S((2, 8, 40), F32), _S((40,), F32), _S((40,), F32))


def _grad(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32)), argnums=(0, 1, 2))


LOWERINGS = {
    "mha": (lambda q, k, v: attention.mha(q, k, v, None, causal=True, block_sizes=BLOCKS), _MHA),
    "mha_backward": (_grad(lambda q, k, v: attention.mha(q, k, v, None, block_sizes=BLOCKS)),
                     _MHA),
    "mqa": (lambda q, k, v, e: decode_attention.mqa(q, k, v, kv_seq_len=e, block_h=16,
                                                    block_k=16, k_splits=2),
            (_S((2, 4, 16), _F16), _S((2, 64, 16), _F16), _S((2, 64, 16), _F16),
             _S((2,), jnp.int32))),
    "gqa": (lambda q, k, v: decode_attention.gqa(q, k, v, block_h=16, block_k=16, k_splits=2),
            (_S((2, 8, 16), _F16), _S((2, 64, 2, 16), _F16), _S((2, 64, 2, 16), _F16))),
    "paged_attention": (
        lambda q, k, v, t, n: paged_attention.paged_attention(
            q, k, v, t, n, block_h=16, pages_per_compute_block=2, k_splits=2),
        (_S((2, 8, 16), _F16), _S((2, 16, 8, 16), _F16), _S((2, 16, 8, 16), _F16),
         _S((2, 8), jnp.int32), _S((2,), jnp.int32))),
    "layer_norm": (layer_norm.layer_norm, _NORM),
    "rms_norm": (rms_norm.rms_norm, _NORM),
    "softmax": (lambda x: softmax.softmax(x, axis=-1), (_S((8, 100), F32),)),
}
# The norm backward passes: their dW/dB kernel gathers with two index arrays
# (x_ref.at[rows[:, None], cols[None]]).
LOWERING_CASES = [*LOWERINGS, "layer_norm_backward", "rms_norm_backward"]


@pytest.mark.parametrize("name", LOWERING_CASES)
def test_lowers_for_cuda(name: str) -> None:
    """Without ``interpret=True`` the params pick the Triton backend, which lowers each kernel
    into XLA's Triton custom call (whole-row blocks of 40 or 100 elements included)."""
    if name.endswith("_backward") and name[: -len("_backward")] in NORMS:
        fn, args = _grad(NORMS[name[: -len("_backward")]][0]), _NORM
    else:
        fn, args = LOWERINGS[name]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def _lowering_case(name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if name.endswith("_backward") and name[: -len("_backward")] in NORMS:
        return _grad(NORMS[name[: -len("_backward")]][0]), _NORM
    return LOWERINGS[name]


@pytest.mark.parametrize("name", LOWERING_CASES)
def test_lowers_for_rocm(name: str) -> None:
    """The same kernels lowered for AMD GPUs: XLA's Triton call again, with JAX's ROCm
    default of one pipeline stage where the kernel names none."""
    fn, args = _lowering_case(name)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("rocm",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert calls and all("num_stages" in line for line in calls)


_BINARY = {"sm_80": "cubin", "sm_90": "cubin", "gfx942": "hsaco"}


@pytest.mark.parametrize("target", list(_BINARY))
@pytest.mark.parametrize("name", LOWERING_CASES)
def test_compiles_for_nvidia_and_amd(name: str, target: str) -> None:
    """Each kernel's TTIR goes through Triton's whole pipeline to a GPU binary (an ELF object
    for NVIDIA, ``e_machine`` 190, or AMD, 224)."""
    pytest.importorskip("triton", reason="compiling Triton IR needs the triton package")
    import pallas_core as pl

    fn, args = _lowering_case(name)
    found = pl.stages(fn, *args, backend="triton", target=target)
    assert found
    for kernel in found:
        binary = kernel[_BINARY[target]]
        assert binary[:4] == b"\x7fELF"
        assert int.from_bytes(binary[18:20], "little") == (224 if target == "gfx942" else 190)
        symbol = "".join(c if c.isalnum() or c == "_" else "_" for c in kernel.name)
        assert symbol.encode() in binary  # the kernel's entry point, by its sanitized name
