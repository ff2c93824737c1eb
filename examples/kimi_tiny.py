"""A tiny Kimi-style decoder (KDA layers + MLPs, Flax NNX) trained with optax to
copy a sequence, then generating with caches: a bucketed varlen prefill into
state pools and a jitted decode loop.

    python examples/kimi_tiny.py [--steps 300] [--implementation triton|xla]

Each example is ``x_1 .. x_L SEP x_1 .. x_L`` with L in [2, MAX_LEN]: after the
separator the model must repeat what came before it, which it can only do
through the layers' recurrent states (the short convolutions see 3 tokens
back). Training runs dense [B, T] batches through ``chunk_kda`` (on the XLA
path token by token, ``--mode fused_recurrent``: for 13-token rows on a CPU
it is an order of magnitude faster than the chunked form); generation
packs the prompts of every length into one :class:`kda_jax.VarlenBatch`,
prefills every layer's conv and KDA states into pool rows (``KDACache.at``),
then decodes all sequences one token per step inside one ``jax.lax.fori_loop``
over the pools (``fused_recurrent_kda``). The same script runs the XLA path
on a CPU and the Triton path on a GPU.

Prints the loss while training, then the copy accuracy of the generated
tokens; exits non-zero when the loss did not fall.
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
from flax import nnx

import kda_jax
from kda_jax.nn import KimiDeltaAttention

SYMBOLS, MAX_LEN = 8, 6
SEP = SYMBOLS
VOCAB = SYMBOLS + 1
T = 2 * MAX_LEN + 1


class Block(nnx.Module):
    """Pre-norm KDA and SwiGLU MLP, each with a residual."""

    def __init__(self, d, heads, head_dim, implementation, mode, rngs):
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = KimiDeltaAttention(d, heads, head_dim, implementation=implementation,
                                       mode=mode, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

    def __call__(self, x, cu_seqlens, cache):
        if cache is None:
            x = x + self.attn(self.attn_norm(x), cu_seqlens=cu_seqlens)
        else:
            h, cache = self.attn(self.attn_norm(x), cu_seqlens=cu_seqlens, cache=cache)
            x = x + h
        m = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(m)) * self.up(m)), cache


class TinyKimi(nnx.Module):
    def __init__(self, *, d=64, layers=2, heads=2, head_dim=32, implementation=None,
                 mode="chunk", rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, head_dim, implementation, mode, rngs)
                                for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs)

    def init_caches(self, rows):
        return [b.attn.init_cache(rows) for b in self.blocks]

    def __call__(self, tokens, *, cu_seqlens=None, caches=None):
        """tokens int32 [B, T] (or packed [1, T]) -> logits [B, T, VOCAB] (and caches)."""
        x = self.embed(tokens)
        new = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, cu_seqlens, None if caches is None else caches[i])
            new.append(c)
        logits = self.head(self.norm(x))
        return logits if caches is None else (logits, new)


def make_batch(rng: np.random.Generator, batch: int):
    """tokens int32 [batch, T], the loss mask [batch, T] (positions predicting a copy)."""
    tokens = np.zeros((batch, T), np.int32)
    mask = np.zeros((batch, T), np.float32)
    for i, n in enumerate(rng.integers(2, MAX_LEN + 1, size=batch)):
        x = rng.integers(0, SYMBOLS, size=n)
        tokens[i, :2 * n + 1] = np.r_[x, SEP, x]
        mask[i, n:2 * n] = 1.0  # position t predicts token t + 1
    return tokens, mask


def loss_fn(model, tokens, mask):
    logits = model(tokens)[:, :-1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * mask[:, :-1]) / jnp.sum(mask)


def default_mode(implementation) -> str:
    """The chunked form where the Triton kernels run (their recurrent kernel is
    forward only), token by token on the XLA path (short rows: far faster)."""
    triton = implementation == "triton" or (
        implementation is None and jax.default_backend() in ("gpu", "cuda", "rocm"))
    return "chunk" if triton else "fused_recurrent"


def train(steps=300, implementation=None, batch=32, seed=0, log_every=0, mode=None):
    """Returns (model, the loss of every step)."""
    model = TinyKimi(implementation=implementation, mode=mode or default_mode(implementation),
                     rngs=nnx.Rngs(seed))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adamw(3e-3, weight_decay=0.0)
    opt_state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, mask):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graph, p, rest), tokens, mask))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, *make_batch(rng, batch))
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.3f}", flush=True)
    return nnx.merge(graph, params, rest), losses


# --------------------------------------------------------------------------- #
# Generation with caches.
# --------------------------------------------------------------------------- #


def generate(model, prompts: list[np.ndarray], new_tokens: int, *, slots: int | None = None):
    """Greedy continuation of every prompt: int32 [N, new_tokens].

    One bucketed varlen prefill writes each prompt's states to pool row n
    (``has_initial_state`` False: the rows' old contents are never read),
    then a jitted loop decodes all N sequences one token per step over the
    pools (a decode bucket: one token per sequence)."""
    n = len(prompts)
    slots = slots or n
    lengths = [len(p) for p in prompts]
    bucket = kda_jax.Bucket.fit(np.r_[0, np.cumsum(lengths)])
    batch = kda_jax.VarlenBatch.from_lengths(lengths, bucket)
    packed = batch.pad_tokens(np.concatenate(prompts).astype(np.int32)[None])
    idx = np.full(bucket.max_seqs, -1, np.int32)
    idx[:n] = np.arange(n)
    last = np.cumsum(lengths) - 1  # each prompt's last token row (host data)
    graph, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, batch, pools):
        caches = [c.at(idx, np.zeros(bucket.max_seqs, bool)) for c in pools]
        logits, caches = nnx.merge(graph, state)(tokens, cu_seqlens=batch, caches=caches)
        return jnp.argmax(logits[0, last], -1).astype(jnp.int32), [c.dense() for c in caches]

    @functools.partial(jax.jit, static_argnums=4)
    def decode(state, first, batch, pools, steps):
        model = nnx.merge(graph, state)

        def body(i, carry):
            out, token, caches = carry
            logits, caches = model(token[None], cu_seqlens=batch, caches=caches)
            token = jnp.argmax(logits[0], -1).astype(jnp.int32)
            return out.at[:, i].set(token), token, caches

        out = jnp.zeros((n, steps), jnp.int32).at[:, 0].set(first)
        caches = [c.at(jnp.arange(n, dtype=jnp.int32)) for c in pools]
        out, _, caches = jax.lax.fori_loop(1, steps, body, (out, first, caches))
        return out

    first, pools = prefill(state, packed, batch, model.init_caches(slots))
    one = kda_jax.VarlenBatch.from_lengths([1] * n, kda_jax.Bucket(n, n, max_len=1))
    return np.asarray(decode(state, first, one, pools, new_tokens))


def generate_without_cache(model, prompts, new_tokens):
    """The same greedy continuation by recomputing every prefix (rows padded to
    T; a causal model's logits at a row do not see the rows after it)."""
    run = jax.jit(lambda t: model(t))
    rows = np.zeros((len(prompts), T + new_tokens), np.int32)
    ends = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    out = np.zeros((len(prompts), new_tokens), np.int32)
    for s in range(new_tokens):
        logits = np.asarray(run(jnp.asarray(rows)))
        out[:, s] = logits[np.arange(len(prompts)), ends - 1].argmax(-1)
        rows[np.arange(len(prompts)), ends] = out[:, s]
        ends = ends + 1
    return out


def copy_prompts(rng, count):
    """(prompts ``x SEP``, the answers ``x``) of random lengths."""
    xs = [rng.integers(0, SYMBOLS, size=n) for n in rng.integers(2, MAX_LEN + 1, size=count)]
    return [np.r_[x, SEP].astype(np.int32) for x in xs], xs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--implementation", default=None, choices=["triton", "xla"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--mode", default=None, choices=["chunk", "fused_recurrent"],
                   help="the layers' KDA form in training; default chunk on a GPU, "
                        "fused_recurrent on the XLA path")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model, losses = train(args.steps, args.implementation, args.batch, log_every=50,
                          mode=args.mode)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f} (chance {np.log(VOCAB):.3f}) in "
          f"{time.perf_counter() - t0:.1f} s on {jax.default_backend()}")
    prompts, answers = copy_prompts(np.random.default_rng(1), args.prompts)
    t0 = time.perf_counter()
    out = generate(model, prompts, MAX_LEN)
    hits = [np.mean(o[:len(a)] == a) for o, a in zip(out, answers)]
    print(f"generated {args.prompts} x {MAX_LEN} tokens with caches in "
          f"{time.perf_counter() - t0:.1f} s; copy accuracy {np.mean(hits):.2f}")
    for prompt, o, a in list(zip(prompts, out, answers))[:3]:
        print(f"  {prompt.tolist()} -> {o[:len(a)].tolist()}")
    return 0 if last < 0.7 * first else 1


if __name__ == "__main__":
    sys.exit(main())
