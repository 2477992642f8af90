"""Seeded random DAG families for training and generalisation tests.

A policy trained on six zoo graphs would learn six graphs; these generators
give it unlimited fresh ones with the *statistics* of real networks:

* ``layered``: ops in levels of random width, each reading 1-3 ops of recent
  levels (a CNN with branches and skip connections);
* ``erdos_renyi``: each pair (i < j) of ops joined with probability p, chosen so
  the mean in-degree is about 2 (Xie et al.'s ER wiring, oriented by index);
* ``watts_strogatz``: a ring lattice of degree k rewired with probability p,
  oriented by index (Xie et al.'s WS wiring, their best RandWire family);
* ``matmul_chains``, ``ffn``, ``transformer``: the model-parallel graphs of the
  device-placement literature, where spreading over several GPUs can pay.

Op costs look like real ops: each op draws a kind from a mix weighted like
imported CNNs and transformers, a tensor size (log-uniform), and derives its
FLOPs, bytes and parameter bytes the way that kind would (a conv's FLOPs from
channels and kernel, an elementwise op's bytes from its tensor, ...).  Edge
bytes are the producer's output size.  Everything is drawn from
``numpy.random.default_rng(seed)``: the same (family, n_ops, seed) always gives
the same graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from opsched.errors import GraphError
from opsched.graph import Edge, Op, OpGraph

#: Kind mix (probabilities) of the synthetic ops, close to imported CNN/transformer graphs.
KIND_MIX: dict[str, float] = {
    "conv": 0.28, "matmul": 0.12, "elementwise": 0.30, "norm": 0.12,
    "pool": 0.06, "concat_split": 0.06, "reduce": 0.04, "other": 0.02,
}


# ----------------------------------------------------------- wiring (edges)
def layered_edges(n: int, rng: np.random.Generator, mean_width: float = 3.0) -> list[tuple[int, int]]:
    """Levels of random width (1..2*mean_width); each op reads 1-3 ops from the
    previous three levels, at least one from the level just before."""
    levels: list[list[int]] = []
    i = 0
    while i < n:
        w = int(min(n - i, rng.integers(1, int(2 * mean_width) + 1)))
        levels.append(list(range(i, i + w)))
        i += w
    edges: set[tuple[int, int]] = set()
    for li in range(1, len(levels)):
        recent = [j for lv in levels[max(0, li - 3):li] for j in lv]
        for dst in levels[li]:
            edges.add((int(rng.choice(levels[li - 1])), dst))
            for _ in range(int(rng.integers(0, 3))):
                edges.add((int(rng.choice(recent)), dst))
    # Every op outside the last level feeds something (no dangling branches).
    for li in range(len(levels) - 1):
        for src in levels[li]:
            if not any(e[0] == src for e in edges):
                edges.add((src, int(rng.choice(levels[li + 1]))))
    return sorted(edges)


def erdos_renyi_edges(n: int, p: float, rng: np.random.Generator) -> list[tuple[int, int]]:
    """G(n, p) on ops 0..n-1, each edge oriented from the lower index (a DAG)."""
    if not 0.0 <= p <= 1.0:
        raise GraphError(f"erdos_renyi: p must be in [0, 1], got {p}")
    upper = np.triu(rng.random((n, n)) < p, k=1)
    return [(int(i), int(j)) for i, j in zip(*np.nonzero(upper), strict=True)]


def watts_strogatz_edges(n: int, k: int, p: float, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Watts-Strogatz: a ring where each node links its k/2 clockwise neighbours,
    each link rewired to a random node with probability p; oriented by index."""
    if k % 2 or k < 2 or k >= n:
        raise GraphError(f"watts_strogatz: k must be even with 2 <= k < n, got k={k}, n={n}")
    adj = [set() for _ in range(n)]
    for i in range(n):
        for j in range(1, k // 2 + 1):
            a, b = i, (i + j) % n
            adj[a].add(b)
            adj[b].add(a)
    for j in range(1, k // 2 + 1):
        for i in range(n):
            b = (i + j) % n
            if b in adj[i] and rng.random() < p:
                choices = [u for u in range(n) if u != i and u not in adj[i]]
                if choices:
                    u = int(rng.choice(choices))
                    adj[i].discard(b)
                    adj[b].discard(i)
                    adj[i].add(u)
                    adj[u].add(i)
    return sorted({(min(i, j), max(i, j)) for i in range(n) for j in adj[i]})


# ------------------------------------------------------------- op costs
def random_op(op_id: str, rng: np.random.Generator, kind: str | None = None) -> Op:
    """One op with costs drawn the way a real op of its kind would have them.

    Sizes follow an ImageNet CNN at batch 1 (float32): a stage s in 0..3 sets
    the feature map (56 >> s pixels square) and the channels (about 64 << s),
    so a conv costs from a few MFLOPs to a few hundred, like ResNet's; matmuls
    are transformer/LSTM sized.  FLOPs are counted like torch's FlopCounterMode
    (a multiply-add is 2; elementwise, pooling, norm ... count 0 and are bound
    by their bytes).
    """
    kinds = list(KIND_MIX)
    if kind is None:
        kind = str(rng.choice(kinds, p=np.array(list(KIND_MIX.values())) / sum(KIND_MIX.values())))
    stage = int(rng.integers(0, 4))
    hw = 56 >> stage
    c = int((64 << stage) * rng.choice([0.5, 1.0, 1.0, 1.5]))
    if kind == "conv":
        k = int(rng.choice([1, 1, 3, 3, 5]))
        cout = int(c * rng.choice([0.5, 1, 1, 2, 4]))
        depthwise = k > 1 and rng.random() < 0.2
        groups = c if depthwise else 1
        cout = c if depthwise else cout
        shape: tuple[int, ...] = (1, cout, hw, hw)
        params = cout * (c // groups) * k * k * 4
        flops = 2.0 * cout * hw * hw * (c // groups) * k * k
        read = c * hw * hw * 4 + params
    elif kind == "matmul":
        m = int(rng.choice([1, 16, 64, 128]))
        kd, nd = (int(2 ** rng.integers(8, 12)) for _ in range(2))
        shape = (m, nd)
        params = kd * nd * 4
        flops = 2.0 * m * kd * nd
        read = m * kd * 4 + params
    else:
        shape = (1, c, hw, hw)
        numel = c * hw * hw
        params = 2 * c * 4 if kind == "norm" else 0
        if kind == "pool":
            shape = (1, c, max(1, hw // 2), max(1, hw // 2))
        read = numel * 4 * (2 if kind in ("elementwise", "concat_split") else 1) + params
        flops = 0.0
    written = float(np.prod(shape)) * 4
    return Op(id=op_id, name=f"{kind}_{op_id}", kind=kind, flops=float(flops), bytes_read=float(read),
              bytes_written=written, param_bytes=float(params), shape=tuple(int(x) for x in shape),
              dtype="float32")


def _build(name: str, n: int, edges: list[tuple[int, int]], rng: np.random.Generator, meta: dict) -> OpGraph:
    ops = [random_op(f"n{i}", rng) for i in range(n)]
    # An op with producers reads what they wrote (plus its weights).
    inbytes = [0.0] * n
    for a, b in edges:
        inbytes[b] += ops[a].bytes_written
    ops = [replace(op, bytes_read=inbytes[i] + op.param_bytes) if inbytes[i] else op for i, op in enumerate(ops)]
    e = [Edge(ops[a].id, ops[b].id, ops[a].bytes_written) for a, b in edges]
    return OpGraph(tuple(ops), tuple(e), name=name, meta=meta)


def layered(n_ops: int = 100, seed: int = 0, mean_width: float = 3.0) -> OpGraph:
    rng = np.random.default_rng(seed)
    edges = layered_edges(n_ops, rng, mean_width)
    return _build(f"layered-{n_ops}-s{seed}", n_ops, edges, rng,
                  {"source": "synthetic", "family": "layered", "seed": seed, "mean_width": mean_width})


def erdos_renyi(n_ops: int = 100, seed: int = 0, p: float | None = None) -> OpGraph:
    """ER DAG; the default p = 4 / n gives a mean in-degree of about 2."""
    rng = np.random.default_rng(seed)
    p = min(1.0, 4.0 / max(n_ops, 1)) if p is None else p
    edges = erdos_renyi_edges(n_ops, p, rng)
    return _build(f"erdos_renyi-{n_ops}-s{seed}", n_ops, edges, rng,
                  {"source": "synthetic", "family": "erdos_renyi", "seed": seed, "p": p})


def watts_strogatz(n_ops: int = 100, seed: int = 0, k: int = 4, p: float = 0.75) -> OpGraph:
    """WS DAG with RandWire's best setting (k = 4, p = 0.75)."""
    rng = np.random.default_rng(seed)
    k_eff = min(k, (n_ops - 1) // 2 * 2)  # tiny graphs: the densest lattice that exists
    edges = watts_strogatz_edges(n_ops, k_eff, p, rng) if k_eff >= 2 else [(i, i + 1) for i in range(n_ops - 1)]
    return _build(f"watts_strogatz-{n_ops}-s{seed}", n_ops, edges, rng,
                  {"source": "synthetic", "family": "watts_strogatz", "seed": seed, "k": k, "p": p})


# ------------------------------------------- model-parallel placement graphs
# The device-placement literature's graphs (Mirhoseini et al.'s and Placeto's
# model-parallel nets, NN Maestro's layer groups, GDP's transformer layers):
# branches of GPU-sized work whose inputs and outputs are large enough that a
# transfer costs about as much as a branch, so where spreading over several
# GPUs pays depends on the link speeds.  Float32, FLOPs counted as 2 per
# multiply-add.

def _mm(op_id: str, m: int, k: int, n: int, kind: str = "matmul") -> Op:
    return Op(id=op_id, name=f"{kind}_{op_id}", kind=kind, flops=2.0 * m * k * n, bytes_read=4.0 * (m * k + k * n),
              bytes_written=4.0 * m * n, param_bytes=4.0 * k * n, shape=(m, n), dtype="float32")


def _ew(op_id: str, m: int, n: int, kind: str = "elementwise", reads: int = 1) -> Op:
    return Op(id=op_id, name=f"{kind}_{op_id}", kind=kind, flops=0.0, bytes_read=4.0 * m * n * reads,
              bytes_written=4.0 * m * n, param_bytes=0.0, shape=(m, n), dtype="float32")


def _wire(name: str, ops: list[Op], pairs: list[tuple[int, int]], meta: dict, n_ops: int, m: int,
          d: int) -> OpGraph:
    """The graph of exactly ``n_ops`` ops: the structure, then a chain of
    activations from its last op up to the count (a structure larger than
    ``n_ops`` becomes a plain chain of ``n_ops`` matmuls of the same size)."""
    if len(ops) > n_ops:
        ops = [_mm(f"mm{i}", m, d, d) for i in range(n_ops)]
        pairs = [(i, i + 1) for i in range(n_ops - 1)]
    last = len(ops) - 1
    while len(ops) < n_ops:
        ops.append(_ew(f"tail{len(ops)}", m, d))
        pairs.append((last, len(ops) - 1))
        last = len(ops) - 1
    edges = [Edge(ops[a].id, ops[b].id, ops[a].bytes_written) for a, b in pairs]
    return OpGraph(tuple(ops), tuple(edges), name=f"{name}-{n_ops}-s{meta['seed']}", meta=meta)


def _placement_size(rng: np.random.Generator, batch: int | None, width: int | None) -> tuple[int, int]:
    m = int(batch) if batch else int(rng.choice((128, 256, 512, 1024, 2048)))
    d = int(width) if width else int(rng.choice((1024, 2048, 4096, 8192)))
    return m, d


def matmul_chains(n_ops: int = 40, seed: int = 0, chains: int = 4, batch: int | None = None,
                  width: int | None = None) -> OpGraph:
    """``chains`` independent chains of big matmuls (each followed by an activation)
    from one input to a final sum: each chain fits one device."""
    rng = np.random.default_rng(seed)
    m, d = _placement_size(rng, batch, width)
    chains = max(1, min(int(chains), max(1, (n_ops - 2) // 2)))
    depth = max(1, (n_ops - 2) // (2 * chains))
    ops, pairs = [_ew("in", m, d, "other")], []
    ends = []
    for c in range(chains):
        prev = 0
        for k in range(depth):
            ops.append(_mm(f"c{c}_mm{k}", m, d, d))
            pairs.append((prev, len(ops) - 1))
            ops.append(_ew(f"c{c}_act{k}", m, d))
            pairs.append((len(ops) - 2, len(ops) - 1))
            prev = len(ops) - 1
        ends.append(prev)
    ops.append(_ew("sum", m, d, reads=chains))
    pairs += [(e, len(ops) - 1) for e in ends]
    return _wire("matmul_chains", ops, pairs,
                 {"source": "synthetic", "family": "matmul_chains", "seed": seed, "batch": m, "width": d}, n_ops, m, d)


def ffn(n_ops: int = 40, seed: int = 0, shards: int = 4, batch: int | None = None, width: int | None = None) -> OpGraph:
    """A feed-forward network split tensor-parallel: each layer is ``shards``
    matmuls on column slices of the weight, gathered by a concat (the
    Megatron-style MLP)."""
    rng = np.random.default_rng(seed)
    m, d = _placement_size(rng, batch, width)
    shards = max(1, int(shards))
    layers = max(1, (n_ops - 1) // (shards + 2))
    ops, pairs = [_ew("in", m, d, "other")], []
    prev = 0
    for layer in range(layers):
        parts = []
        for s in range(shards):
            ops.append(_mm(f"l{layer}_s{s}", m, d, 4 * d // shards))
            pairs.append((prev, len(ops) - 1))
            parts.append(len(ops) - 1)
        ops.append(_ew(f"l{layer}_gather", m, 4 * d, "concat_split"))
        pairs += [(p, len(ops) - 1) for p in parts]
        ops.append(_mm(f"l{layer}_down", m, 4 * d, d))
        pairs.append((len(ops) - 2, len(ops) - 1))
        prev = len(ops) - 1
    return _wire("ffn", ops, pairs, {"source": "synthetic", "family": "ffn", "seed": seed, "batch": m, "width": d,
                                     "shards": shards}, n_ops, m, d)


def transformer(n_ops: int = 60, seed: int = 0, heads: int = 8, batch: int | None = None,
                width: int | None = None) -> OpGraph:
    """Transformer encoder layers with their attention heads as parallel branches
    (per head: Q/K/V projections, attention, into the output projection), then
    the MLP; residual adds and layer norms between (GDP's and Placeto's graphs)."""
    rng = np.random.default_rng(seed)
    m, d = _placement_size(rng, batch, width)
    heads = max(1, int(heads))
    dh = max(1, d // heads)
    per_layer = 4 * heads + 7
    layers = max(1, (n_ops - 1) // per_layer)
    ops, pairs = [_ew("in", m, d, "other")], []
    x = 0
    for layer in range(layers):
        outs = []
        for h in range(heads):
            qkv = []
            for t in "qkv":
                ops.append(_mm(f"l{layer}_h{h}_{t}", m, d, dh))
                pairs.append((x, len(ops) - 1))
                qkv.append(len(ops) - 1)
            seq = max(1, min(m, 512))
            att = Op(id=f"l{layer}_h{h}_att", name=f"attention_l{layer}_h{h}", kind="attention",
                     flops=4.0 * m * seq * dh, bytes_read=12.0 * m * dh, bytes_written=4.0 * m * dh,
                     param_bytes=0.0, shape=(m, dh), dtype="float32")
            ops.append(att)
            pairs += [(q, len(ops) - 1) for q in qkv]
            outs.append(len(ops) - 1)
        ops.append(_ew(f"l{layer}_concat", m, d, "concat_split"))
        pairs += [(o, len(ops) - 1) for o in outs]
        ops.append(_mm(f"l{layer}_proj", m, d, d))
        pairs.append((len(ops) - 2, len(ops) - 1))
        ops.append(_ew(f"l{layer}_res1", m, d, reads=2))
        pairs += [(len(ops) - 2, len(ops) - 1), (x, len(ops) - 1)]
        ops.append(_ew(f"l{layer}_norm1", m, d, "norm"))
        pairs.append((len(ops) - 2, len(ops) - 1))
        n1 = len(ops) - 1
        ops.append(_mm(f"l{layer}_up", m, d, 4 * d))
        pairs.append((n1, len(ops) - 1))
        ops.append(_mm(f"l{layer}_down", m, 4 * d, d))
        pairs.append((len(ops) - 2, len(ops) - 1))
        ops.append(_ew(f"l{layer}_res2", m, d, reads=2))
        pairs += [(len(ops) - 2, len(ops) - 1), (n1, len(ops) - 1)]
        x = len(ops) - 1
    return _wire("transformer", ops, pairs, {"source": "synthetic", "family": "transformer", "seed": seed,
                                             "batch": m, "width": d, "heads": heads}, n_ops, m, d)


# ------------------------------------------------------------- hard families
# Instances built to be hard for list heuristics (issue 23; paired with the
# machines of :mod:`opsched.hard`, which measures each family's gap to the
# best known plan).  Each is deterministic for a seed, any n_ops >= 1.

def fork_join(n_ops: int = 26, seed: int = 0, width: int = 8, heavy: float = 0.5, batch: int | None = None,
              width_dim: int | None = None) -> OpGraph:
    """PISA's hard case for HEFT (Coleman and Krishnamachari): a fork of
    ``width`` branches of big matmuls joined by one op, where the last op of
    a ``heavy`` share of the branches writes a large tensor (16x its input)
    the join reads.  On slow links a heavy branch belongs on the join's
    device, a light one wherever it finishes first -- but a list heuristic
    places each branch by its own finish time, before it sees the join."""
    rng = np.random.default_rng(seed)
    m, d = _placement_size(rng, batch, width_dim)
    width = max(1, min(int(width), max(1, n_ops - 2)))
    depth = max(1, (n_ops - 2) // width)
    n_heavy = int(round(heavy * width))
    heavy_set = set(rng.permutation(width)[:n_heavy].tolist())
    ops, pairs = [_ew("in", m, d, "other")], []
    ends = []
    for b in range(width):
        prev = 0
        for k in range(depth):
            last = k == depth - 1
            if last and b in heavy_set:  # a wide projection: 16x the bytes of its input
                ops.append(_mm(f"b{b}_out{k}", m, d, 16 * d))
            else:
                ops.append(_mm(f"b{b}_mm{k}", m, d, d))
            pairs.append((prev, len(ops) - 1))
            prev = len(ops) - 1
        ends.append(prev)
    reads = sum(ops[e].bytes_written for e in ends)
    join = Op(id="join", name="concat_split_join", kind="concat_split", flops=0.0, bytes_read=reads,
              bytes_written=4.0 * m * d, param_bytes=0.0, shape=(m, d), dtype="float32")
    ops.append(join)
    pairs += [(e, len(ops) - 1) for e in ends]
    return _wire("fork_join", ops, pairs, {"source": "synthetic", "family": "fork_join", "seed": seed, "batch": m,
                                           "width": width, "heavy": sorted(heavy_set)}, n_ops, m, d)


def _sized_op(op_id: str, rng: np.random.Generator, lo: float, hi: float) -> Op:
    """A conv or matmul whose FLOPs are log-uniform in [lo, hi] (small tensors)."""
    flops = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
    kind = str(rng.choice(["conv", "matmul"]))
    side = int(max(1, np.sqrt(flops / 2.0) // 64))
    return Op(id=op_id, name=f"{kind}_{op_id}", kind=kind, flops=flops, bytes_read=4.0 * 64 * side * 2,
              bytes_written=4.0 * 64 * side, param_bytes=4.0 * 64 * side, shape=(64, side), dtype="float32")


def mixed_scaling(n_ops: int = 100, seed: int = 0, decades: float = 3.5) -> OpGraph:
    """Layered wiring whose ops span ``decades`` orders of magnitude of FLOPs
    (10^5 up): on a manycore CPU a small op is fastest on a few threads (a
    team's sync cost grows with it) and a big one on all cores, so thread
    scaling is non-monotone over the graph and no one team size fits."""
    rng = np.random.default_rng(seed)
    edges = layered_edges(n_ops, rng, 3.0)
    ops = [_sized_op(f"n{i}", rng, 1e5, 1e5 * 10 ** decades) for i in range(n_ops)]
    e = [Edge(ops[a].id, ops[b].id, ops[a].bytes_written) for a, b in edges]
    return OpGraph(tuple(ops), tuple(e), name=f"mixed_scaling-{n_ops}-s{seed}",
                   meta={"source": "synthetic", "family": "mixed_scaling", "seed": seed, "decades": decades})


def memory_bound(n_ops: int = 80, seed: int = 0, compute_share: float = 0.25) -> OpGraph:
    """Layered wiring of big elementwise and norm ops (bound by memory
    bandwidth) with a ``compute_share`` of convolutions: on a machine with
    little bandwidth co-running ops slow each other down
    (:meth:`~opsched.engine.models.analytic.AnalyticModel.slowdown`)."""
    rng = np.random.default_rng(seed)
    edges = layered_edges(n_ops, rng, 4.0)
    ops = [random_op(f"n{i}", rng, "conv" if rng.random() < compute_share
                     else str(rng.choice(["elementwise", "norm", "elementwise", "pool"])))
           for i in range(n_ops)]
    inbytes = [0.0] * n_ops
    for a, b in edges:
        inbytes[b] += ops[a].bytes_written
    ops = [replace(op, bytes_read=inbytes[i] + op.param_bytes) if inbytes[i] else op for i, op in enumerate(ops)]
    e = [Edge(ops[a].id, ops[b].id, ops[a].bytes_written) for a, b in edges]
    return OpGraph(tuple(ops), tuple(e), name=f"memory_bound-{n_ops}-s{seed}",
                   meta={"source": "synthetic", "family": "memory_bound", "seed": seed})


def dcgan(n_ops: int = 14, seed: int = 0, batch: int | None = None, width: float = 1.0) -> OpGraph:
    """DCGAN's generator (Radford et al. 2016; one of Liu et al.'s four
    networks): z (100) -> a projection to 4x4x(1024 w) -> four transposed
    convolutions (5x5, stride 2, halving the channels, doubling the side; the
    last to 3 channels at 64x64), batch norm and ReLU between, tanh at the
    end.  The batch is ``batch``, or drawn from ``seed`` (16 to 128);
    ``n_ops`` pads with a chain of activations as the other families do."""
    batch = int(batch) if batch else int(np.random.default_rng(seed).choice((16, 32, 64, 128)))
    c = int(1024 * width)
    ops: list[Op] = [_mm("project", batch, 100, 16 * c)]
    pairs: list[tuple[int, int]] = []
    side, ch = 4, c
    ops.append(Op(id="bn0", name="norm_bn0", kind="norm", flops=0.0, bytes_read=4.0 * batch * 16 * c,
                  bytes_written=4.0 * batch * 16 * c, param_bytes=8.0 * c, shape=(batch, c, 4, 4), dtype="float32"))
    pairs.append((0, 1))
    for k in range(4):
        out_ch = 3 if k == 3 else ch // 2
        out_side = side * 2
        flops = 2.0 * batch * out_side * out_side * out_ch * ch * 25 / 4  # stride 2: a quarter of the taps hit
        act_in = 4.0 * batch * ch * side * side
        act_out = 4.0 * batch * out_ch * out_side * out_side
        ops.append(Op(id=f"deconv{k}", name=f"conv_deconv{k}", kind="conv", flops=flops,
                      bytes_read=act_in + 4.0 * ch * out_ch * 25, bytes_written=act_out,
                      param_bytes=4.0 * ch * out_ch * 25, shape=(batch, out_ch, out_side, out_side), dtype="float32"))
        pairs.append((len(ops) - 2, len(ops) - 1))
        kind = "elementwise" if k == 3 else "norm"
        ops.append(Op(id=f"act{k}", name=f"{kind}_act{k}", kind=kind, flops=0.0, bytes_read=act_out,
                      bytes_written=act_out, param_bytes=0.0, shape=(batch, out_ch, out_side, out_side),
                      dtype="float32"))
        pairs.append((len(ops) - 2, len(ops) - 1))
        side, ch = out_side, out_ch
    return _wire("dcgan", ops, pairs, {"source": "synthetic", "family": "dcgan", "seed": seed, "batch": batch,
                                       "width": width}, max(n_ops, 1), batch, 16)


FAMILIES: dict[str, Callable[..., OpGraph]] = {
    "layered": layered,
    "erdos_renyi": erdos_renyi,
    "watts_strogatz": watts_strogatz,
    "matmul_chains": matmul_chains,
    "ffn": ffn,
    "transformer": transformer,
}
#: The model-parallel families (graphs where placement over several GPUs can pay).
PLACEMENT_FAMILIES = ("matmul_chains", "ffn", "transformer")
#: The families made hard for list heuristics (:mod:`opsched.hard`), and DCGAN.  Kept apart from
#: :data:`FAMILIES`, whose mix is the environment's default graph distribution; :func:`generate`
#: and the ``FAMILY:N:SEED`` specs know both.
HARD_FAMILIES: dict[str, Callable[..., OpGraph]] = {
    "fork_join": fork_join,
    "mixed_scaling": mixed_scaling,
    "memory_bound": memory_bound,
    "dcgan": dcgan,
}
#: Every generator by name.
GENERATORS: dict[str, Callable[..., OpGraph]] = {**FAMILIES, **HARD_FAMILIES}


def generate(family: str, n_ops: int = 100, seed: int = 0, **options: float) -> OpGraph:
    """A random graph of ``family`` with ``n_ops`` ops; deterministic for a seed."""
    if family not in GENERATORS:
        raise GraphError(f"unknown synthetic family {family!r}; the families are: {', '.join(GENERATORS)}")
    if int(n_ops) < 1:
        raise GraphError(f"synthetic {family}: n_ops must be >= 1, got {n_ops}")
    try:
        return GENERATORS[family](int(n_ops), int(seed), **options)
    except TypeError as exc:
        raise GraphError(f"synthetic {family}: bad option ({exc})") from None


__all__ = ["FAMILIES", "GENERATORS", "HARD_FAMILIES", "KIND_MIX", "PLACEMENT_FAMILIES", "generate", "layered", "erdos_renyi",
           "watts_strogatz", "matmul_chains", "ffn", "transformer", "fork_join", "mixed_scaling", "memory_bound",
           "dcgan",
           "layered_edges", "erdos_renyi_edges", "watts_strogatz_edges", "random_op"]
