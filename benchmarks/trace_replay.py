"""Acceptance replayed from a trace of the embedded model: what a trained target and drafter would accept, inside a
loop whose models have random weights (`ddtree_full_scale.py`).

DDTree builds its tree from the drafter's per-depth distributions after the bonus token, and accepts the longest
root path whose tokens are the target's choices along it. Under greedy decoding both are functions of the text
position alone: at position p of a greedy text g (bonus g[p], committed prefix prompt + g[:p]) the drafter proposes
the same distributions whatever steps led there, and the target's choice at a node of depth d on the path that
matches g is g[p + d + 1]. `record` takes both from the embedded model (`kdtree_jax.load("builtin")`) on held-out
prompts: its greedy text, then the drafter's log-probabilities at every position, all positions drafted at once
from one prefill of the whole text (the drafter sees the context below the bonus's position, as in the loop).

`Traced` is a `Speculative` (ddtree at a fixed budget or budget="auto") that runs every stage for real (draft,
tree build, verify, accept, keep) but builds its tree from the trace's distributions at each row's position and
lets accept walk the trace's choices (`Speculative.propose` and `Speculative.choices` replaced). So the tree, the
nodes auto verifies and the accepted length are what the embedded pair gives at that position, and the row's
position moves on by what it committed. The models' own outputs still flow into the replaced values (a select on
a test that is never true), so no stage is compiled away. The trace's token ids are the embedded model's (< 264);
the target's vocabulary must hold them. A row past the trace's last position starts it again from position 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import kdtree_jax as kj
from kdtree_jax.ddtree import DraftTree, Speculative, speculative
from kdtree_jax.decoding import DecodeState, Sampler
from kdtree_jax.drafter import draft
from kdtree_jax.model import init_cache

FAR = -1e4  # the log-probability of a token outside the trace's vocabulary: never in a tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trace:
    """Greedy texts and the drafter's distributions along them, one stream per row (row b replays stream b % C),
    by position: what the drafter proposes with the bonus at position p, and the target's tokens after it. A stream
    may be several texts one after another (`chain`); `offset` moves every row's start (the same compiled loop)."""

    bonus: jax.Array  # int32 [C, P]          g[p]: the bonus at position p
    cont: jax.Array  # int32 [C, P, D + 1]    g[p + 1 .. p + D + 1]: the target's greedy tokens after it
    logp: jax.Array  # f32 [C, P, D, V]       the drafter's log-probabilities at depths 1..D with bonus g[p]
    offset: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))  # int32 []: position of step 0

    @property
    def positions(self) -> int:
        return self.logp.shape[1]

    @property
    def streams(self) -> int:
        return self.logp.shape[0]

    def chain(self, streams: int) -> "Trace":
        """The texts joined into `streams` streams (C a multiple of it): stream i is texts i k .. i k + k - 1 in
        turn, k = C / streams (at a join the next text starts: a new document, as a server sees)."""
        if streams < 1 or self.streams % streams:
            raise ValueError(f"{self.streams} texts do not split into {streams} streams")
        join = lambda a: a.reshape(streams, -1, *a.shape[2:])
        return Trace(bonus=join(self.bonus), cont=join(self.cont), logp=join(self.logp), offset=self.offset)

    def at(self, offset: int) -> "Trace":
        return dataclasses.replace(self, offset=jnp.int32(offset % self.positions))


def record(model, prompts: list[list[int]], positions: int) -> Trace:
    """The embedded model's trace on `prompts` (one stream each, all of one length): `positions` + depth + 1
    greedy tokens after each prompt, and the drafter's log-probabilities at the first `positions` of them."""
    cfg, params, drafter = model.cfg, model.params, model.drafter
    depth = drafter.depth
    lp = {len(p) for p in prompts}
    if len(lp) != 1:
        raise ValueError(f"the prompts must share one length, got {sorted(lp)}")
    lp = lp.pop()
    n_text = positions + depth + 1
    texts = kj.generate(params, cfg, prompts, max_new_tokens=n_text, method="ar").tokens
    if any(len(t) != n_text for t in texts):
        raise ValueError("a greedy text ended early (EOS); choose other prompts or fewer positions")
    text = np.asarray(texts, np.int32)  # [C, T]
    windows = np.arange(positions)[:, None] + np.arange(1, depth + 2)[None, :]  # [P, D + 1]
    method = speculative(cfg, "ddtree", drafter, 1)
    full = np.concatenate([np.asarray(prompts, np.int32), text[:, :-1]], axis=1)  # the committed tokens, whole
    cache = init_cache(cfg, len(prompts), -(-full.shape[1] // 64) * 64 + 64)
    lengths = jnp.full((len(prompts),), full.shape[1], jnp.int32)
    _, _, state = jax.jit(lambda t, n, c: method.start(params, cfg, t, n, c, None))(jnp.asarray(full), lengths, cache)
    one = jax.jit(lambda st, lens, bonus: jax.nn.log_softmax(draft(drafter, params, st, lens, bonus), axis=-1))
    logp = []
    for c in range(len(prompts)):
        rows = jax.tree.map(lambda a: jnp.repeat(a[c:c + 1], positions, axis=0), state)
        lens = jnp.asarray(lp + np.arange(positions), jnp.int32)
        logp.append(one(rows, lens, jnp.asarray(text[c, :positions])))
    return Trace(bonus=jnp.asarray(text[:, :positions]), cont=jnp.asarray(text[:, windows]),
                 logp=jnp.stack(logp).astype(jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Traced(Speculative):
    """A `Speculative` whose trees come from the trace's distributions and whose accepted paths follow the trace's
    greedy texts (module docstring). Make one with `traced`."""

    trace: Trace | None = None

    def _where(self, s: DecodeState) -> tuple[jax.Array, jax.Array]:
        """(stream, position) of every row: stream b % C, position (offset + tokens committed - 1) mod P."""
        b = s.num_out.shape[0]
        return (jnp.arange(b) % self.trace.streams,
                (self.trace.offset + jnp.maximum(s.num_out - 1, 0)) % self.trace.positions)

    def propose(self, params, cfg, s: DecodeState, sampler: Sampler) -> jax.Array:
        real = super().propose(params, cfg, s, sampler)  # [B, D, V]: the drafter's work, kept
        stream, pos = self._where(s)
        lp = self.trace.logp[stream, pos]  # [B, D, Vt]
        if lp.shape[-1] > real.shape[-1]:
            raise ValueError(f"the trace's {lp.shape[-1]} token ids do not fit the target's vocabulary of "
                             f"{real.shape[-1]}")
        lp = jnp.pad(lp, ((0, 0), (0, 0), (0, real.shape[-1] - lp.shape[-1])), constant_values=FAR)
        return jnp.where(jnp.isnan(real), real, lp)

    def choices(self, target: jax.Array, tree: DraftTree, s: DecodeState) -> jax.Array:
        stream, pos = self._where(s)
        cont = self.trace.cont[stream, pos]  # [B, D + 1]
        want = jnp.take_along_axis(cont, jnp.clip(tree.depths, 0, cont.shape[1] - 1), axis=1)
        return jnp.where(target == jnp.iinfo(jnp.int32).min, target, want)  # the sampler's work, kept


def traced(method: Speculative, trace: Trace) -> Traced:
    """`method` (ddtree, a fixed budget or auto) replaying `trace`, whose depth must be the drafter's."""
    if method.name != "ddtree":
        raise ValueError(f"a trace replays ddtree, got {method.name!r}")
    if trace.logp.shape[2] != method.drafter.depth:
        raise ValueError(f"the trace has {trace.logp.shape[2]} depths, the drafter {method.drafter.depth}")
    if trace.cont.shape[2] != method.drafter.depth + 1:
        raise ValueError(f"the trace holds {trace.cont.shape[2]} tokens after each position, the drafter needs "
                         f"{method.drafter.depth + 1}")
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}
    return Traced(**fields, trace=trace)

