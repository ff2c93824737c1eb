"""kda_jax.nn.KimiDeltaAttention against a pure-JAX transcription of fla's layer
(float32, the reference recurrence, one sequence at a time), and against itself:
prefill + decode through the cache equals one prefill, a packed batch equals its
sequences one by one, the pool form equals the dense form. XLA path, and the
Triton path in the interpreter (tiny shapes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import kda_jax  # noqa: E402
from kda_jax.nn import KDACache, KimiDeltaAttention, to_fla_state_dict  # noqa: E402
from kda_jax.nn import layer as layer_module  # noqa: E402

HIDDEN, H, HV, K, EXPAND_V, W = 16, 1, 2, 8, 2, 4
V = K * EXPAND_V
LENGTHS = [3, 0, 1, 6]  # an empty sequence, one shorter than the conv window


@pytest.fixture(autouse=True)
def _float32_products():
    """Float32 matrix products in the projections: on a GPU XLA's default for
    float32 is tf32 (about 1e-3 relative), which alone misses the float32 bar
    this file holds the layer to; the CPU computes in float32 either way."""
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _built(**kw):
    layer = KimiDeltaAttention(HIDDEN, H, K, num_v_heads=HV, expand_v=EXPAND_V, conv_size=W,
                               rngs=nnx.Rngs(0), **kw)
    # Non-trivial norm weights and gate parameters (fla's init makes them ones / tiny).
    rng = np.random.default_rng(7)
    layer.o_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, V), layer.o_norm.weight.dtype)
    layer.A_log[...] = jnp.asarray(rng.uniform(-1.0, 0.5, HV), jnp.float32)
    layer.dt_bias[...] = jnp.asarray(rng.normal(0, 0.5, HV * K), jnp.float32)
    return layer


def make_layer(implementation="xla", **kw):
    """A copy of one layer (built once: initialization costs seconds on a CPU)."""
    layer = nnx.clone(_built(**kw))
    layer.implementation = implementation
    return layer


def call(layer, x, cu_seqlens=None, cache=None):
    """The layer under jax.jit: one compile instead of one per operation."""
    if cu_seqlens is not None and not isinstance(cu_seqlens, kda_jax.VarlenBatch):
        cu_seqlens = kda_jax.SeqBounds(np.asarray(cu_seqlens))
    return jax.jit(lambda x, b, c: layer(x, cu_seqlens=b, cache=c))(x, cu_seqlens, cache)


def random_cache(n, seed=1):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return KDACache(f(n, W - 1, H * K), f(n, W - 1, H * K), f(n, W - 1, HV * V),
                    0.3 * f(n, HV, K, V))


# --------------------------------------------------------------------------- #
# The transcription: fla's layer written out with fla's weight layouts.
# --------------------------------------------------------------------------- #


def _conv(p, name, inp, state):
    """inp [T, C], state [W-1, C] -> (silu(conv), last W-1 inputs)."""
    w = p[f"{name}.weight"][:, 0, :]  # [C, W]: tap W-1 is the current token
    full = jnp.concatenate([state, inp])
    t = inp.shape[0]
    out = sum(full[j:j + t] * w[:, j] for j in range(W))
    return jax.nn.silu(out), full[full.shape[0] - (W - 1):]


def transcribe_one(p, x, conv_states, h0, eps=1e-5):
    """One sequence: x [T, hidden]; conv_states (q, k, v) [W-1, C]; h0 [HV, K, V]."""
    t = x.shape[0]
    lin = lambda a, key: a @ p[key].T
    q, cq = _conv(p, "q_conv1d", lin(x, "q_proj.weight"), conv_states[0])
    k, ck = _conv(p, "k_conv1d", lin(x, "k_proj.weight"), conv_states[1])
    v, cv = _conv(p, "v_conv1d", lin(x, "v_proj.weight"), conv_states[2])
    g = lin(lin(x, "f_proj.0.weight"), "f_proj.1.weight")
    beta = lin(x, "b_proj.weight")
    o, h = kda_jax.naive_recurrent_kda(
        q.reshape(1, t, H, K), k.reshape(1, t, H, K), v.reshape(1, t, HV, V),
        g.reshape(1, t, HV, K), beta.reshape(1, t, HV), initial_state=h0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=p["A_log"], dt_bias=p["dt_bias"], use_beta_sigmoid_in_kernel=True)
    gate = (lin(lin(x, "g_proj.0.weight"), "g_proj.1.weight") + p["g_proj.1.bias"])
    o = o[0]
    o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + eps) * p["o_norm.weight"]
    o = o * jax.nn.sigmoid(gate.reshape(t, HV, V))
    return lin(o.reshape(t, HV * V), "o_proj.weight"), (cq, ck, cv), h[0]


def transcribe(p, x_packed, lengths, cache):
    """Packed x [R, hidden] -> (y [sum(lengths), hidden], final conv states, final h)."""
    cu = np.r_[0, np.cumsum(lengths)]
    ys, convs, hs = [], [], []
    for i in range(len(lengths)):
        y, c, h = transcribe_one(p, x_packed[cu[i]:cu[i + 1]],
                                 (cache.conv_q[i], cache.conv_k[i], cache.conv_v[i]),
                                 cache.recurrent[i])
        ys.append(y)
        convs.append(c)
        hs.append(h)
    stack = lambda j: jnp.stack([c[j] for c in convs])
    return jnp.concatenate(ys), KDACache(stack(0), stack(1), stack(2), jnp.stack(hs))


def _inputs(total, seed=3):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((1, total, HIDDEN)),
                       jnp.float32)


def _close(check_close, got: KDACache, want: KDACache, what):
    for name in ("conv_q", "conv_k", "conv_v", "recurrent"):
        check_close(getattr(got, name), getattr(want, name), "float32", f"{what} {name}",
                    kind="state")


def _prefill_then_decode(call, layer, x, n, cache=None):
    """(y [B, T, hidden], cache): the first n tokens of x [B, T, hidden] as one prefill
    from ``cache`` (default: a fresh one), then one jitted decode step per token."""
    cache = layer.init_cache(x.shape[0]) if cache is None else cache
    y, cache = call(layer, x[:, :n], cache=cache)
    ys = [y]
    step = jax.jit(lambda x, c: layer(x, cache=c))
    for t in range(n, x.shape[1]):
        y, cache = step(x[:, t:t + 1], cache)
        ys.append(y)
    return jnp.concatenate(ys, axis=1), cache


# --------------------------------------------------------------------------- #
# Forward against the transcription.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("form", ["host", "bucket"])
def test_layer_matches_transcription(form, check_close):
    layer = make_layer()
    p = to_fla_state_dict(layer)
    lengths = LENGTHS
    total = sum(lengths)
    x = _inputs(total)
    cache = random_cache(len(lengths))
    want_y, want_cache = jax.jit(lambda x, c: transcribe(p, x, lengths, c))(x[0], cache)
    if form == "host":
        y, new = call(layer, x, np.r_[0, np.cumsum(lengths)], cache)
        y = y[0]
    else:
        bucket = kda_jax.Bucket(max_seqs=6, max_tokens=16)
        batch = kda_jax.VarlenBatch.from_lengths(lengths, bucket)
        padded = KDACache(*(jnp.concatenate([a, jnp.full((2,) + a.shape[1:], 9.0)])
                            for a in cache[:4]))
        y, new = call(layer, batch.pad_tokens(x), batch, padded)
        assert np.all(np.asarray(y[0, total:]) == 0), "rows past the real tokens must be 0"
        for a, b in zip(new[:4], padded[:4]):  # padded sequence slots keep their states
            np.testing.assert_array_equal(np.asarray(a[4:]), np.asarray(b[4:]))
        y, new = y[0, :total], KDACache(*(a[:4] for a in new[:4]))
    check_close(y, want_y, "float32", "y")
    _close(check_close, new, want_cache, form)


def test_layer_without_cache_is_the_zero_cache(check_close):
    layer = make_layer()
    x = _inputs(10)
    cu = np.array([0, 4, 10])
    y0, _ = call(layer, x, cu, layer.init_cache(2))
    np.testing.assert_allclose(np.asarray(call(layer, x, cu)), np.asarray(y0),
                               rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- #
# Self-consistency: prefill + decode, packed vs one by one, pool vs dense.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_prefill_then_decode_equals_one_prefill(implementation, monkeypatch, check_close):
    # Decode steps run the recurrent form. On the Triton path (the interpreter)
    # the 5-token prefill takes the chunked form (threshold lowered); on the
    # XLA path the recurrent one (the chunked form's compile is the slow part
    # on a CPU, and its gradient is checked below).
    if implementation == "triton":
        monkeypatch.setattr(layer_module, "RECURRENT_MAX_TOKENS", 2)
    layer = make_layer(implementation)
    x = _inputs(16).reshape(2, 8, HIDDEN)
    full, whole = call(layer, x, cache=layer.init_cache(2))
    ys, cache = _prefill_then_decode(call, layer, x, 5)
    check_close(ys, full, "float32", "y prefill+decode")
    _close(check_close, cache, whole, "prefill+decode")


def test_packed_equals_one_by_one(check_close):
    # On the Triton path (the interpreter); for the XLA path the transcription
    # above is the one-by-one run.
    layer = make_layer("triton")
    total = sum(LENGTHS)
    x = _inputs(total, seed=5)
    cache = random_cache(len(LENGTHS), seed=2)
    cu = np.r_[0, np.cumsum(LENGTHS)]
    y, new = call(layer, x, cu, cache)
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        one = KDACache(*(a[i:i + 1] for a in cache[:4]))
        y_i, new_i = call(layer, x[:, cu[i]:cu[i + 1]], cache=one)
        check_close(y[:, cu[i]:cu[i + 1]], y_i, "float32", f"y seq {i}")
        _close(check_close, KDACache(*(a[i:i + 1] for a in new[:4])), new_i, f"seq {i}")


@pytest.mark.parametrize("bucketed, implementation",
                         [(False, "xla"), (True, "xla"), (True, "triton")])
def test_pool_form_equals_dense_form(bucketed, implementation):
    layer = make_layer(implementation)
    lengths = [2, 1, 4]
    x = _inputs(7, seed=9)
    pool = random_cache(5, seed=4)
    idx = np.array([3, 0, 1], np.int32)
    has = np.array([True, False, True])
    dense = KDACache(*(a[idx] for a in pool[:4]))
    dense = dense._replace(**{f: getattr(dense, f).at[1].set(0) for f in
                              ("conv_q", "conv_k", "conv_v", "recurrent")})
    cu = np.r_[0, np.cumsum(lengths)]
    y_dense, new_dense = call(layer, x, cu, dense)
    if bucketed:
        batch = kda_jax.VarlenBatch.from_lengths(lengths, kda_jax.Bucket(4, 8))
        cache = pool.at(jnp.asarray(np.r_[idx, 2]), jnp.asarray(np.r_[has, True]))
        y, new = call(layer, batch.pad_tokens(x), batch, cache)
        y = y[:, :7]
    else:
        y, new = call(layer, x, cu, pool.at(idx, has))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_dense), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(new.has_initial_state)) and new.state_indices is not None
    for name in ("conv_q", "conv_k", "conv_v", "recurrent"):
        got, before = np.asarray(getattr(new, name)), np.asarray(getattr(pool, name))
        np.testing.assert_allclose(got[idx], np.asarray(getattr(new_dense, name)),
                                   rtol=1e-5, atol=1e-6)
        untouched = [r for r in range(5) if r not in idx]  # slot 2 of the padded slot too
        np.testing.assert_array_equal(got[untouched], before[untouched])


# --------------------------------------------------------------------------- #
# Gradients against autodiff of the transcription.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_gradients_match_transcription(implementation, monkeypatch, check_rel_rms):
    # Triton: the chunked form (its recurrent form has no backward); XLA: the
    # recurrent form (chosen with a cache of short inputs; the chunked XLA
    # path's autodiff is covered by tests/test_grad.py).
    if implementation == "triton":
        monkeypatch.setattr(layer_module, "RECURRENT_MAX_TOKENS", 0)
    layer = make_layer(implementation)
    lengths = [3, 6]
    cu = np.r_[0, np.cumsum(lengths)]
    x = _inputs(9, seed=11)
    cache = random_cache(2, seed=6)
    rng = np.random.default_rng(12)
    dy = jnp.asarray(rng.standard_normal((9, HIDDEN)), jnp.float32)
    dh = jnp.asarray(rng.standard_normal(cache.recurrent.shape), jnp.float32)
    graph, params = nnx.split(layer, nnx.Param)

    def ours(params, x, h0):
        y, new = nnx.merge(graph, params)(x, cu_seqlens=cu, cache=cache._replace(recurrent=h0))
        return jnp.sum(y[0] * dy) + jnp.sum(new.recurrent * dh)

    def reference(p, x, h0):
        y, new = transcribe(p, x[0], lengths, cache._replace(recurrent=h0))
        return jnp.sum(y * dy) + jnp.sum(new.recurrent * dh)

    g_ours = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(params, x, cache.recurrent)
    p = {k: jnp.asarray(v) for k, v in to_fla_state_dict(layer).items()}
    g_ref = jax.jit(jax.grad(reference, argnums=(0, 1, 2)))(p, x, cache.recurrent)
    mapped = to_fla_state_dict(g_ours[0], layer)
    for key, want in g_ref[0].items():
        check_rel_rms(mapped[key], want, 1e-4, f"d{key}")
    check_rel_rms(g_ours[1], g_ref[1], 1e-4, "dx")
    check_rel_rms(g_ours[2], g_ref[2], 1e-4, "dh0")


# --------------------------------------------------------------------------- #
# Errors.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_v_heads=3), "num_v_heads=3 must be a multiple of num_heads=2"),
    (dict(expand_v=0.3), "expand_v=0.3"),
    (dict(mode="naive"), "mode='naive'"),
    (dict(safe_gate=True), "safe_gate=True needs lower_bound"),
    (dict(lower_bound=-6.0), r"lower_bound=-6.0 must lie in \[-5, 0\)"),
    (dict(chunk_size=16), "chunk_size=16"),
    (dict(implementation="cuda"), "implementation='cuda'"),
    (dict(conv_size=0), "conv_size=0"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KimiDeltaAttention(HIDDEN, 2, K, rngs=nnx.Rngs(0), **kwargs)


def test_unknown_fla_option_raises():
    with pytest.raises(TypeError, match="layer_idx"):
        KimiDeltaAttention(HIDDEN, 2, K, layer_idx=0, rngs=nnx.Rngs(0))


def test_call_errors():
    layer = make_layer()
    x = _inputs(6)
    with pytest.raises(ValueError, match="hidden_size=16"):
        layer(jnp.zeros((1, 6, 8)))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        layer(x.astype(jnp.int32))
    with pytest.raises(ValueError, match="packed"):
        layer(jnp.zeros((2, 3, HIDDEN)), cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=5 must equal T=6"):
        layer(x, cu_seqlens=[0, 5])
    with pytest.raises(TypeError, match="cu_seqlens"):
        layer(x, cu_seqlens=jnp.array([0, 6]))
    with pytest.raises(ValueError, match="cache holds 3 sequences"):
        layer(x, cu_seqlens=[0, 2, 6], cache=layer.init_cache(3))
    with pytest.raises(ValueError, match="has_initial_state is only used with"):
        layer(x, cache=layer.init_cache(1)._replace(has_initial_state=np.array([True])))
    bad = layer.init_cache(1)._replace(conv_v=jnp.zeros((1, W, HV * V)))
    with pytest.raises(ValueError, match=r"cache.conv_v must have shape \(1, 3, 32\)"):
        layer(x, cache=bad)
    with pytest.raises(TypeError, match="KDACache"):
        layer(x, cache=(1, 2))
    with pytest.raises(ValueError, match="state_indices"):  # the API's host check
        layer(x, cache=layer.init_cache(2).at(np.array([5], np.int32)))


def test_dense_cache_keeps_its_dtypes_in_a_decode_loop():
    # bf16 projections write bf16 conv states; a float32 cache must stay float32
    # (a fori_loop's carry keeps its types).
    layer = make_layer(dtype=jnp.bfloat16)
    x = _inputs(2).reshape(2, 1, HIDDEN).astype(jnp.bfloat16)
    cache = layer.init_cache(2, dtype=jnp.float32)
    body = lambda i, c: layer(x, cache=c)[1]
    out = jax.jit(lambda c: jax.lax.fori_loop(0, 2, body, c))(cache)
    assert [a.dtype for a in out[:4]] == [jnp.float32] * 4
    assert layer.init_cache(1).conv_q.dtype == jnp.bfloat16


@pytest.mark.parametrize("form,implementation", [("dense", "xla"), ("pool", "xla"),
                                                 ("pool", "triton")])
@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_state_cache_prefill_then_decode(form, implementation, state_dtype,
                                                check_close):
    """A 16-bit KDA state (init_cache(state_dtype=...)), dense or a pool,
    against the same steps with a float32 one: the prefill's states are the
    float32 cache's rounded once, bit for bit; y and the final states within
    the dtype's tolerance; the state keeps its dtype from step to step."""
    layer = make_layer(implementation)
    x = _inputs(16).reshape(2, 8, HIDDEN)
    idx = np.array([3, 1], np.int32)

    def cache(dtype):
        if form == "dense":
            return layer.init_cache(2, state_dtype=dtype)
        return layer.init_cache(4, state_dtype=dtype).at(jnp.asarray(idx))

    def states(c):
        return c.recurrent if form == "dense" else c.recurrent[idx]

    name = jnp.dtype(state_dtype).name
    _, first32 = call(layer, x[:, :5], cache=cache(jnp.float32))
    _, first16 = call(layer, x[:, :5], cache=cache(state_dtype))
    assert first16.recurrent.dtype == state_dtype
    np.testing.assert_array_equal(np.asarray(states(first16)),
                                  np.asarray(states(first32).astype(state_dtype)))
    y32, last32 = _prefill_then_decode(call, layer, x, 5, cache(jnp.float32))
    y16, last16 = _prefill_then_decode(call, layer, x, 5, cache(state_dtype))
    assert last16.recurrent.dtype == state_dtype and last32.recurrent.dtype == jnp.float32
    check_close(y16, y32, name, "y 16-bit state")
    check_close(states(last16), states(last32), name, "recurrent 16-bit state", kind="state")
    if form == "pool":  # rows no sequence names stay zero
        np.testing.assert_array_equal(np.asarray(last16.recurrent, np.float32)[[0, 2]], 0)


def test_init_cache_rejects_a_non_float_state_dtype():
    with pytest.raises(TypeError, match="state_dtype=<class 'jax.numpy.int32'> must be float32, "
                                        "bfloat16 or float16"):
        make_layer().init_cache(2, state_dtype=jnp.int32)
    # None names itself (NumPy would read it as float64).
    with pytest.raises(TypeError, match="state_dtype=None must be float32"):
        make_layer().init_cache(2, state_dtype=None)


# --------------------------------------------------------------------------- #
# Empty inputs: T = 0 or B = 0 return empty results, as the kernels do.
# --------------------------------------------------------------------------- #


def _assert_same_cache(got: KDACache, want: KDACache, what):
    for name in ("conv_q", "conv_k", "conv_v", "recurrent"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {name}: {a.shape} {a.dtype}"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} {name}")


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_no_tokens_returns_empty_and_keeps_the_states(mode):
    # T = 0: y [B, 0, hidden]; every sequence is empty, so its conv and KDA
    # states come back as they went in (the transcription's, too).
    layer = make_layer(mode=mode)
    x = jnp.zeros((2, 0, HIDDEN), jnp.float32)
    y = call(layer, x)
    assert y.shape == (2, 0, HIDDEN) and y.dtype == jnp.float32
    cache = random_cache(2)
    p = {k: jnp.asarray(v) for k, v in to_fla_state_dict(layer).items()}
    _, want = transcribe(p, x[0], [0, 0], cache)
    for cu, xs in ((None, x), ([0, 0, 0], x[:1])):  # dense [2, 0] and packed [1, 0]
        y, new = call(layer, xs, cu, cache)
        assert y.shape == (xs.shape[0], 0, HIDDEN) and y.dtype == jnp.float32
        assert new.state_indices is None
        _assert_same_cache(new, want, f"T = 0, cu_seqlens={cu}")
    # A pool: the named rows keep their states (has_initial_state all True).
    pool = random_cache(3, seed=5)
    y, new = call(layer, x, cache=pool.at(jnp.asarray([2, 0], jnp.int32)))
    assert y.shape == (2, 0, HIDDEN)
    _assert_same_cache(new, pool, "T = 0, pool")


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_no_sequences_returns_empty_results(mode):
    # B = 0: y [0, T, hidden] in the dtype a non-empty call gives; an empty
    # dense cache comes back empty, a pool unchanged (prefill and decode).
    layer = make_layer(mode=mode)
    for t in (0, 1, 5):
        y = call(layer, jnp.zeros((0, t, HIDDEN), jnp.float32))
        assert y.shape == (0, t, HIDDEN) and y.dtype == jnp.float32
    empty = layer.init_cache(0)
    assert empty.recurrent.shape == (0, HV, K, V) and empty.conv_v.shape == (0, W - 1, HV * V)
    pool = random_cache(3, seed=8)
    for t in (1, 5):  # a decode step and a prefill
        x = jnp.zeros((0, t, HIDDEN), jnp.float32)
        y, new = call(layer, x, cache=empty)
        assert y.shape == (0, t, HIDDEN) and y.dtype == jnp.float32
        _assert_same_cache(new, empty, f"B = 0, T = {t}, dense")
        none = jnp.zeros((0,), jnp.int32)
        y, new = call(layer, x, cache=pool.at(none, jnp.zeros((0,), bool)))
        assert y.shape == (0, t, HIDDEN)
        assert new.state_indices.shape == (0,) and new.has_initial_state.shape == (0,)
        _assert_same_cache(new, pool, f"B = 0, T = {t}, pool")


def test_empty_inputs_keep_the_layer_dtype():
    layer = make_layer(dtype=jnp.bfloat16)
    want = call(layer, jnp.zeros((1, 1, HIDDEN), jnp.bfloat16)).dtype
    for shape in ((2, 0, HIDDEN), (0, 3, HIDDEN)):
        y = call(layer, jnp.zeros(shape, jnp.bfloat16))
        assert y.shape == shape and y.dtype == want
    y, new = call(layer, jnp.zeros((0, 1, HIDDEN), jnp.bfloat16), cache=layer.init_cache(0))
    assert y.dtype == want and new.conv_q.dtype == layer.init_cache(1).conv_q.dtype


def test_init_cache_rejects_a_negative_count():
    with pytest.raises(ValueError, match="num_seqs=-1 must be a non-negative int"):
        make_layer().init_cache(-1)


def test_decode_after_prefill_poisons_what_one_prefill_does(monkeypatch):
    """Non-finite inputs (docs/kda.md section 6) through the layer on the XLA
    path: a NaN in x during the prefill (sequence 0, token 3) and a +inf during
    the decode (sequence 1, token 6). A 5-token prefill (the chunked form) then
    one-token decodes (the recurrent form) put NaN on the same outputs and
    states as one 8-token prefill: those of the poisoned sequence from its bad
    token on; sequence 2 and the earlier tokens are those of the clean input."""
    monkeypatch.setattr(layer_module, "RECURRENT_MAX_TOKENS", 2)
    layer = make_layer("xla")
    clean = _inputs(24, seed=13).reshape(3, 8, HIDDEN)
    x = clean.at[0, 3, 5].set(jnp.nan).at[1, 6, 2].set(jnp.inf)
    full, whole = call(layer, x, cache=layer.init_cache(3))
    full_clean, whole_clean = call(layer, clean, cache=layer.init_cache(3))
    ys, cache = _prefill_then_decode(call, layer, x, 5)
    steps = np.asarray(ys)
    full, full_clean = np.asarray(full), np.asarray(full_clean)
    expected = np.zeros((3, 8), bool)
    expected[0, 3:] = expected[1, 6:] = True
    for got, what in ((full, "one prefill"), (steps, "prefill + decode")):
        np.testing.assert_array_equal(np.isnan(got).all(-1), expected, err_msg=what)
        np.testing.assert_array_equal(np.isfinite(got).all(-1), ~expected, err_msg=what)
        np.testing.assert_allclose(got[~expected], full_clean[~expected], rtol=1e-5,
                                   atol=1e-6, err_msg=what)
    for got in (whole, cache):
        h = np.asarray(got.recurrent)
        assert np.isnan(h[:2]).all()
        np.testing.assert_allclose(h[2], np.asarray(whole_clean.recurrent)[2], rtol=1e-5,
                                   atol=1e-6)


# --------------------------------------------------------------------------- #
# Speculative verify: the conv and KDA states roll back together.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_verify_equals_one_token_steps(implementation, check_close):
    """layer.verify on 1 + S tokens: y and every kept row (conv and KDA) are
    those of one-token steps from the accepted row's states, and the
    transcription's; rows no token names are unchanged."""
    layer = make_layer(implementation)
    n, w, slots = 3, 3, 12
    pool = random_cache(slots, seed=5)
    rows = np.array([[0, 1, 2], [3, -1, 5], [6, 7, 8]], np.int32)
    acc = np.array([2, 1, 3], np.int32)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((n, w, HIDDEN)), jnp.float32)
    verify = jax.jit(lambda x, c, a: layer.verify(x, cache=c, num_accepted_tokens=a))
    y, new = verify(x, pool.at(jnp.asarray(rows)), jnp.asarray(acc))
    assert new.state_indices.shape == (n, w)

    start = rows[np.arange(n), acc - 1]
    dense = KDACache(*(a[start] for a in pool[:4]))
    want_y, _ = transcribe(to_fla_state_dict(layer), x.reshape(n * w, HIDDEN), [w] * n, dense)
    check_close(y.reshape(n * w, HIDDEN), want_y, "float32", "y")
    ys, fields = [], ("conv_q", "conv_k", "conv_v", "recurrent")
    for t in range(w):
        y_t, dense = call(layer, x[:, t:t + 1], cache=dense)
        ys.append(y_t)
        for i in np.flatnonzero(rows[:, t] >= 0):
            for name in fields:
                np.testing.assert_allclose(
                    np.asarray(getattr(new, name)[rows[i, t]]),
                    np.asarray(getattr(dense, name)[i]), rtol=1e-6, atol=1e-7,
                    err_msg=f"{name} after token {t} of sequence {i}")
    np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.concatenate(ys, axis=1)),
                               rtol=1e-6, atol=1e-7)
    for name in fields:
        got, before = np.asarray(getattr(new, name)), np.asarray(getattr(pool, name))
        np.testing.assert_array_equal(got[9:], before[9:], err_msg=name)
        np.testing.assert_array_equal(got[4], before[4], err_msg=name)  # the -1 column


def test_verify_errors():
    layer = make_layer()
    pool = random_cache(8)
    x = jnp.zeros((2, 3, HIDDEN), jnp.float32)
    with pytest.raises(ValueError, match=r"state_indices are \[N, 1 \+ S\] = \(2, 3\)"):
        layer.verify(x, cache=pool.at(np.array([0, 1], np.int32)))
    with pytest.raises(ValueError, match=r"state_indices are \[N, 1 \+ S\] = \(2, 3\)"):
        layer.verify(x, cache=pool.at(np.zeros((2, 2), np.int32)))
    with pytest.raises(ValueError, match=r"speculative verify's \[N, 1 \+ S\] rows; run the "
                                         r"step with layer.verify"):
        layer(x, cache=pool.at(np.arange(6, dtype=np.int32).reshape(2, 3)))
    with pytest.raises(ValueError, match=r"num_accepted_tokens\[1\]=4 is outside \[1, 3\]"):
        layer.verify(x, cache=pool.at(np.arange(6, dtype=np.int32).reshape(2, 3)),
                     num_accepted_tokens=np.array([1, 4], np.int32))
    # Counts of the wrong length: named before the conv rows use them.
    with pytest.raises(ValueError, match=r"num_accepted_tokens must have shape \(2,\)"):
        layer.verify(x, cache=pool.at(np.arange(6, dtype=np.int32).reshape(2, 3)),
                     num_accepted_tokens=np.array([1, 2, 3], np.int32))


def test_verify_without_sequences_returns_empty_results():
    """N = 0, as __call__ with B = 0: y [0, 1 + S, hidden] in the layer's
    dtype, the pool unchanged."""
    layer = make_layer()
    pool = random_cache(3, seed=8)
    x = jnp.zeros((0, 3, HIDDEN), jnp.float32)
    y, new = layer.verify(x, cache=pool.at(jnp.zeros((0, 3), jnp.int32)),
                          num_accepted_tokens=jnp.zeros((0,), jnp.int32))
    assert y.shape == (0, 3, HIDDEN) and y.dtype == call(layer, x).dtype
    _assert_same_cache(new, pool, "N = 0, verify")
