"""kda_jax.nn.from_fla_state_dict and the cache conversions, on a synthetic state
dict with fla's names and shapes (no torch)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from kda_jax.nn import (KimiDeltaAttention, cache_from_fla, cache_to_fla,  # noqa: E402
                        from_fla_state_dict, to_fla_state_dict)

HIDDEN, H, HV, K, V, W = 12, 2, 4, 4, 8, 3  # expand_v = 2


def fla_state_dict(conv_bias: bool, seed=0) -> dict[str, np.ndarray]:
    """What fla's KimiDeltaAttention(hidden_size=12, expand_v=2, head_dim=4,
    num_heads=2, num_v_heads=4, conv_size=3, conv_bias=...) holds, by shape."""
    rng = np.random.default_rng(seed)
    shapes = {
        "q_proj.weight": (H * K, HIDDEN), "k_proj.weight": (H * K, HIDDEN),
        "v_proj.weight": (HV * V, HIDDEN),
        "q_conv1d.weight": (H * K, 1, W), "k_conv1d.weight": (H * K, 1, W),
        "v_conv1d.weight": (HV * V, 1, W),
        "f_proj.0.weight": (V, HIDDEN), "f_proj.1.weight": (HV * K, V),
        "b_proj.weight": (HV, HIDDEN), "A_log": (HV,), "dt_bias": (HV * K,),
        "g_proj.0.weight": (V, HIDDEN), "g_proj.1.weight": (HV * V, V),
        "g_proj.1.bias": (HV * V,), "o_norm.weight": (V,), "o_proj.weight": (HIDDEN, HV * V),
    }
    if conv_bias:
        shapes.update({"q_conv1d.bias": (H * K,), "k_conv1d.bias": (H * K,),
                       "v_conv1d.bias": (HV * V,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def make_layer(conv_bias=False, **kw):
    return KimiDeltaAttention(HIDDEN, H, K, num_v_heads=HV, expand_v=2, conv_size=W,
                              conv_bias=conv_bias, implementation="xla", rngs=nnx.Rngs(1), **kw)


@pytest.mark.parametrize("conv_bias", [False, True])
def test_state_dict_round_trip_and_layouts(conv_bias):
    sd = fla_state_dict(conv_bias)
    layer = from_fla_state_dict(sd, make_layer(conv_bias))
    back = to_fla_state_dict(layer)
    assert back.keys() == sd.keys()
    for key, value in sd.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    # Layouts: a Linear is x @ weight.T, a conv tap w of channel c is weight[c, 0, w].
    np.testing.assert_array_equal(np.asarray(layer.q_proj.kernel[...]), sd["q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(layer.v_conv1d.kernel[...])[1, 5],
                                  sd["v_conv1d.weight"][5, 0, 1])
    np.testing.assert_array_equal(np.asarray(layer.f_proj.layers[1].kernel[...]),
                                  sd["f_proj.1.weight"].T)


def test_prefix():
    # (bf16 parameters: tests/test_bench_layer.py loads fla's weights into them.)
    sd = {"model.layers.0.attn." + k: v.astype(np.float64) for k, v in
          fla_state_dict(False).items()}
    sd["model.layers.0.mlp.weight"] = np.zeros(3)  # another module's key: not under the prefix
    layer = from_fla_state_dict(sd, make_layer(), prefix="model.layers.0.attn.")
    assert layer.o_proj.kernel[...].dtype == jnp.float32  # cast to the parameter's dtype
    np.testing.assert_array_equal(np.asarray(layer.A_log[...]),
                                  sd["model.layers.0.attn.A_log"].astype(np.float32))


def test_state_dict_errors_name_the_key():
    sd = fla_state_dict(False)
    layer = make_layer()
    with pytest.raises(ValueError, match=r"lacks \['k_conv1d.bias', 'q_conv1d.bias'"):
        from_fla_state_dict(sd, make_layer(conv_bias=True))
    with pytest.raises(ValueError, match=r"keys this layer has no parameter for: \['k_conv1d.bias'"):
        from_fla_state_dict(fla_state_dict(True), layer)
    from_fla_state_dict(fla_state_dict(True), layer, strict=False)
    layer = make_layer()
    bad = dict(sd, **{"o_proj.weight": sd["o_proj.weight"].T})
    with pytest.raises(ValueError, match=r"state_dict\['o_proj.weight'\] has shape \(32, 12\)"):
        from_fla_state_dict(bad, layer)
    np.testing.assert_array_equal(np.asarray(layer.q_proj.kernel[...]), np.asarray(
        make_layer().q_proj.kernel[...]))  # nothing loaded


@pytest.mark.parametrize("state_v_first", [False, True])
def test_cache_conversion(state_v_first):
    layer = make_layer(state_v_first=state_v_first)
    rng = np.random.default_rng(3)
    n = 2
    conv = tuple(rng.standard_normal((n, c, W)).astype(np.float32)
                 for c in (H * K, H * K, HV * V))
    h = rng.standard_normal((n, HV, V, K)).astype(np.float32)  # fla's layer: V-first
    cache = cache_from_fla(conv, h, layer)
    assert cache.conv_v.shape == (n, W - 1, HV * V)
    # Ours holds fla's last W - 1 inputs, channels last.
    np.testing.assert_array_equal(np.asarray(cache.conv_k)[1, :, 3], conv[1][1, 3, 1:])
    want = h if state_v_first else np.swapaxes(h, -1, -2)
    np.testing.assert_array_equal(np.asarray(cache.recurrent), want)
    conv_back, h_back = cache_to_fla(cache, layer)
    np.testing.assert_array_equal(h_back, h)
    for a, b in zip(conv_back, conv):
        np.testing.assert_array_equal(a[..., 1:], b[..., 1:])
        assert np.all(a[..., 0] == 0)
