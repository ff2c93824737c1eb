"""Train a tiny model with one KDA layer on a synthetic recall task, with optax,
inside jax.jit.

    python examples/train_tiny.py [--steps 300] [--implementation triton|xla]

Each sequence lists PAIRS key/value token pairs, then one of the keys again;
the model must answer with that key's value. The KDA state stores the pairs
(delta rule: beta k v^T) and the query reads its value back, so a model
without the layer stays at chance (log(VALUES) nats). The script prints the
loss as it trains and exits non-zero when the loss did not fall.

The layer uses the in-kernel transforms as Kimi Linear does: L2-normalized
q and k, the gate -exp(A_log) * softplus(g + dt_bias), beta = sigmoid(logit).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kda_jax

KEYS, VALUES = 16, 16
VOCAB = KEYS + VALUES  # keys are tokens [0, KEYS), values [KEYS, VOCAB)
PAIRS = 8
T = 2 * PAIRS + 1
D, H, DK = 64, 2, 32  # model width, heads, head dim (K = V = DK)


def make_batch(rng: np.random.Generator, batch: int):
    """tokens int32 [batch, T] and the answers int32 [batch] (a value token)."""
    keys = np.stack([rng.permutation(KEYS)[:PAIRS] for _ in range(batch)])
    vals = rng.integers(KEYS, VOCAB, size=(batch, PAIRS))
    pick = rng.integers(0, PAIRS, size=batch)
    tokens = np.empty((batch, T), np.int32)
    tokens[:, 0:-1:2], tokens[:, 1:-1:2], tokens[:, -1] = keys, vals, keys[np.arange(batch), pick]
    return tokens, vals[np.arange(batch), pick].astype(np.int32)


def init_params(key) -> dict:
    ks = jax.random.split(key, 8)
    dense = lambda k, n, m: jax.random.normal(k, (n, m), jnp.float32) / np.sqrt(n)
    return dict(
        embed=jax.random.normal(ks[0], (VOCAB, D), jnp.float32),
        wq=dense(ks[1], D, H * DK), wk=dense(ks[2], D, H * DK), wv=dense(ks[3], D, H * DK),
        wg=dense(ks[4], D, H * DK), wb=dense(ks[5], D, H),
        A_log=jnp.zeros((H,), jnp.float32), dt_bias=jnp.zeros((H * DK,), jnp.float32),
        wo=dense(ks[6], H * DK, D), unembed=dense(ks[7], D, VOCAB),
    )


def forward(params, tokens, implementation):
    """Logits [batch, VOCAB] at the last position."""
    b = tokens.shape[0]
    x = params["embed"][tokens]  # [b, T, D]
    heads = lambda w: (x @ w).reshape(b, T, H, DK)
    o, _ = kda_jax.chunk_kda(
        heads(params["wq"]), heads(params["wk"]), heads(params["wv"]), heads(params["wg"]),
        x @ params["wb"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=params["A_log"], dt_bias=params["dt_bias"], use_beta_sigmoid_in_kernel=True,
        chunk_size=32, implementation=implementation)
    y = x + o.reshape(b, T, H * DK) @ params["wo"]
    return y[:, -1] @ params["unembed"]


def loss_fn(params, tokens, answers, implementation):
    logits = forward(params, tokens, implementation)
    return optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()


def train(steps: int = 300, implementation: str | None = None, batch: int = 64,
          seed: int = 0, log_every: int = 0) -> list[float]:
    """Trains for ``steps`` steps; returns the loss of every step."""
    rng = np.random.default_rng(seed)
    params = init_params(jax.random.PRNGKey(seed))
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, tokens, answers):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, answers, implementation)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        tokens, answers = make_batch(rng, batch)
        params, state, loss = step(params, state, tokens, answers)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.3f}", flush=True)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--implementation", default=None, choices=["triton", "xla"])
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    losses = train(args.steps, args.implementation, args.batch, log_every=25)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f} (chance {np.log(VALUES):.3f}) in "
          f"{time.perf_counter() - t0:.1f} s on {jax.default_backend()}")
    return 0 if last < 0.7 * first else 1


if __name__ == "__main__":
    sys.exit(main())
