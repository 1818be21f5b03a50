"""Tree verify and commit kernels of speculative decoding (DDTree), per layer: numpy references, unit, launcher.

A tree is N nodes in topological order: parents[n] < n, parents[0] = -1 (the root), depth[n] = depth of parents[n]
+ 1; node n holds the token at absolute position start + depth[n] and is computed as the decode step at that
position after the committed sequence [0, start) and n's ancestors (lucegen.spec_decode.verify.tree_forward on the
numpy backend). The kernels (templates/tree.cuh) are the decode step's device functions driven over the tree, so a
1-node tree is the decode step (the layer driver uses them for plain decoding too) and a chain the chain verify.

Per Gated DeltaNet layer: `deltanet` verifies (raw head outputs per node; the committed conv ring and state are only
read), `deltanet_commit` replays the accepted path (its nodes' in-projection rows, a chain) into the committed state
and ring. Per attention layer: `attention_kv` writes node n's K/V to cache row start + n, `attention` computes the
gated outputs with the ancestor mask, `kv_commit` moves the accepted rows to start .. start + len - 1.
Layouts as lucegen.engine.state: ring fp32 [K, conv_dim] (slot p % K: position p's raw input), recurrent state
fp32 [Hv, dv, dk], caches bf16 [context, n_kv, head_dim].
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model import kvformats
from ..model.config import ModelConfig
from ..reference.attention import causal_attention
from ..reference.deltanet import causal_conv1d, recurrent_gated_delta_rule
from ..reference.ops import apply_rope, rms_norm, rope_cos_sin, sigmoid, silu, softplus
from ..spec import ChipSpec
from .attention import split_qkv
from .conv1d import ring_to_state
from .megakernel import rope_inv_freq

DN_THREADS = 128   # a DeltaNet item: 4 warps over a slice of value columns
DN_SLICE = 16      # value columns per item, at most (Qwen3.5-0.8B: 16 heads x 8 slices = 128 items)
KV_THREADS = 128
ATT_WARPS = 8  # tree_attention's block, at least (and G + 2 warps: attention_queries)
ATT_ROWS = 8   # K/V rows each warp of tree_attention has in flight at most: a round of attention_item_gqa holds its
               # heads x rows scores, at most 32. An item's chunk is at least one round of its warps (27B at context
               # 512: 6,480 us a token against 6,547 with chunks of 2 rows a warp, session 21 run 3)
KV_ROWS = {"bf16": "KVBf16", "q8_0": "KVQ8_0", "q4_0": "KVQ4_0", "tq3_0": "KVTQ3_0"}  # the formats it reads (kv.cuh)
ATT_MAX_THREADS = 384  # a thread of tree_attention takes ~170 registers (65,536 / 384); more threads spill
NULL = (0, ctypes.c_void_p)
VERIFY, STEP_COMMIT, PATH_COMMIT = 0, 1, 2  # tree_deltanet's commit argument (templates/tree.cu.j2)


def kv_rows(spec: ChipSpec, cfg: ModelConfig) -> str:
    """The format of the KV rows the tree kernels write and read: the spec's tuning.kv_format where they take it and
    the model's head_dim is whole groups of it (tq3_0: 128 values), else bf16 (fp8 rows are not read by the tree
    attention yet)."""
    fmt = spec.tuning.kv_format
    if fmt not in KV_ROWS:
        return "bf16"
    try:
        kvformats.check(fmt, cfg.head_dim)
    except kvformats.KVFormatError:
        return "bf16"
    return fmt


def att_heads(cfg: ModelConfig) -> int:
    """The query heads a warp of tree_attention attends (mk_attention.cuh: attention_gqa_heads): the largest divisor
    of G up to 6."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return max(d for d in range(1, min(6, group) + 1) if group % d == 0)


def att_threads(cfg: ModelConfig) -> int:
    """tree_attention's threads: ATT_WARPS warps or G + 2, in whole sets of the G / att_heads warps that take a
    position's heads."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    groups = group // att_heads(cfg)
    return 32 * -(-max(ATT_WARPS, group + 2) // groups) * groups


def att_rows(cfg: ModelConfig) -> int:
    """The K/V rows a warp of tree_attention reads a round: at most ATT_ROWS, and at most 32 scores."""
    return max(1, min(ATT_ROWS, 32 // att_heads(cfg)))


def att_min_chunk(cfg: ModelConfig) -> int:
    """An item's positions at least: one round of its warps."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return att_threads(cfg) // 32 // (group // att_heads(cfg)) * att_rows(cfg)


def _io(io):
    """The io pointer argument: a DeviceArray, or null (the position is the launch's start alone)."""
    return NULL if io is None else io


# ---- tree shape -------------------------------------------------------------------------------------------------
def depths(parents: Sequence[int]) -> np.ndarray:
    """depth [N] of a topologically ordered tree; a clear error for anything else."""
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1:
        raise ValueError(f"tree: parents[0] must be -1 (the root); got {parents[:1]}")
    depth = np.zeros(len(parents), np.int32)
    for n, p in enumerate(parents[1:], 1):
        if not 0 <= p < n:
            raise ValueError(f"tree: parents[{n}] = {p}; a node's parent must be an earlier node (0 <= p < {n})")
        depth[n] = depth[p] + 1
    return depth


def stack_levels(max_nodes: int) -> int:
    """The DeltaNet stack levels a tree of max_nodes nodes may need: floor(log2(max_nodes))."""
    return max(1, max_nodes.bit_length() - 1)


def schedule(parents: Sequence[int]) -> tuple[np.ndarray, int]:
    """The DeltaNet items' walk over the tree: (codes [N] in visit order, stack levels used).

    Depth-first, each node's children by subtree size, largest last. A node with several children saves its state
    to a new stack level; its first child continues from registers, the others restore the level, the last one
    frees it. A light child's subtree holds at most half its parent's nodes, so at most floor(log2 N) levels are in
    use at once. Code: node | (restore level + 1) << 16 | (save level + 1) << 24 (templates/tree.cuh: step_node).
    """
    depths(parents)
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    for c in range(1, n):
        children[parents[c]].append(c)
    size = np.ones(n, np.int64)
    for c in range(n - 1, 0, -1):
        size[parents[c]] += size[c]
    codes, top, used = [], 0, 0
    todo = [(0, -1, False)]  # (node, level to restore or -1, whether restoring frees the level)
    while todo:
        node, restore, frees = todo.pop()
        if frees:
            top -= 1
        kids = sorted(children[node], key=lambda c: (size[c], c))
        save = -1
        if len(kids) > 1:
            save, top = top, top + 1
            used = max(used, top)
        codes.append(node | (restore + 1) << 16 | (save + 1) << 24)
        for i in range(len(kids) - 1, -1, -1):
            todo.append((kids[i], -1 if i == 0 else save, i == len(kids) - 1 and i > 0))
    return np.array(codes, np.int32), used


def check_path(parents: Sequence[int], path: Sequence[int]) -> None:
    """An accepted path: root first, each node a child of the one before it."""
    if not path or path[0] != 0:
        raise ValueError(f"tree path: must start at the root (node 0); got {list(path)[:1]}")
    for i in range(1, len(path)):
        if not 0 < path[i] < len(parents) or parents[path[i]] != path[i - 1]:
            raise ValueError(f"tree path: path[{i}] = {path[i]} is not a child of path[{i - 1}] = {path[i - 1]}")


# ---- numpy references (the reference model's math, node by node) -------------------------------------------------
def deltanet_reference(cfg: ModelConfig, mixed: np.ndarray, conv_w: np.ndarray, a_log: np.ndarray,
                       dt_bias: np.ndarray, ring: np.ndarray, state: np.ndarray, parents: Sequence[int], start: int,
                       tiled: bool = False):
    """Node by node, the decode step after its parent: (raw head outputs [N, Hv * dv], each node's conv state
    [K-1, C] (the reference's layout) and recurrent state [Hv, dv, dk] (the device's) after it).

    mixed [N, C + value_dim + 2 Hv] in-projection rows; conv_w [C, K]; ring [K, C] and state [Hv, dv, dk] the
    committed ones at position start (state read only when start > 0). tiled: the value heads in llama.cpp's tiled
    order (a GGUF's: value head h reads key head h % Hk), else HF's grouped one (h // (Hv / Hk))."""
    C, VD, Hk, Hv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    depths(parents)
    root_conv = ring_to_state(ring, start)
    root_rec = state.transpose(0, 2, 1) if start > 0 else None
    out = np.empty((len(parents), Hv * dv), np.float32)
    convs, recs = [], []
    for n, p in enumerate(parents):
        y, conv = causal_conv1d(mixed[n:n + 1, :C], conv_w, root_conv if p < 0 else convs[p])
        q, k, v = np.split(silu(y), [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        beta = sigmoid(mixed[n:n + 1, C + VD:C + VD + Hv])
        g = -np.exp(a_log) * softplus(mixed[n:n + 1, C + VD + Hv:] + dt_bias)
        expand = (lambda a: np.tile(a, (1, Hv // Hk, 1))) if tiled else (lambda a: np.repeat(a, Hv // Hk, axis=1))
        q, k = expand(q.reshape(1, Hk, dk)), expand(k.reshape(1, Hk, dk))
        o, S = recurrent_gated_delta_rule(q, k, v.reshape(1, Hv, dv), g, beta,
                                          root_rec if p < 0 else recs[p].transpose(0, 2, 1))
        out[n] = o.reshape(-1)
        convs.append(conv)
        recs.append(np.ascontiguousarray(S.transpose(0, 2, 1)))
    return out, convs, recs


def deltanet_commit_reference(mixed: np.ndarray, ring: np.ndarray, state: np.ndarray, recs: Sequence[np.ndarray],
                              path: Sequence[int], start: int) -> tuple[np.ndarray, np.ndarray]:
    """(ring, state) after the accepted path: its raw inputs in the ring at positions start .., the last node's
    recurrent state (recs from deltanet_reference)."""
    ring = ring.copy()
    for i, n in enumerate(path):
        ring[(start + i) % ring.shape[0]] = mixed[n, :ring.shape[1]]
    return ring, (recs[path[-1]] if path else state).copy()


def attention_kv_reference(cfg: ModelConfig, qkv: np.ndarray, k_norm: np.ndarray, parents: Sequence[int],
                           start: int) -> tuple[np.ndarray, np.ndarray]:
    """The nodes' K (k_norm, RoPE at start + depth) and V rows [N, n_kv, head_dim]."""
    _, _, k, v = split_qkv(cfg, qkv)
    cos, sin = rope_cos_sin(start + depths(parents), cfg.rotary_dim, cfg.rope_theta)
    return apply_rope(rms_norm(k, k_norm, cfg.rms_norm_eps), cos, sin), v


def attention_reference(cfg: ModelConfig, qkv: np.ndarray, q_norm: np.ndarray, keys: np.ndarray,
                        values: np.ndarray, parents: Sequence[int], start: int) -> np.ndarray:
    """[N, n_heads * head_dim]: node n's query (q_norm, RoPE at start + depth[n]) attends the committed rows
    [0, start) and its ancestors' and its own rows (row start + m for node m, as attention_kv leaves the cache
    [start + N, n_kv, head_dim]), times the sigmoid output gate."""
    q, gate, _, _ = split_qkv(cfg, qkv)
    cos, sin = rope_cos_sin(start + depths(parents), cfg.rotary_dim, cfg.rope_theta)
    q = apply_rope(rms_norm(q, q_norm, cfg.rms_norm_eps), cos, sin)
    out = np.empty((len(parents), cfg.num_attention_heads * cfg.head_dim), np.float32)
    for n in range(len(parents)):
        rows, a = [], n
        while a >= 0:
            rows.append(start + a)
            a = parents[a]
        rows = list(range(start)) + rows[::-1]
        o = causal_attention(q[n:n + 1], keys[rows], values[rows], cfg.head_dim ** -0.5)
        out[n] = o.reshape(-1) * sigmoid(gate[n])
    return out


def kv_commit_reference(cache: np.ndarray, path: Sequence[int], start: int) -> np.ndarray:
    """A cache whose rows start + path[i] (node rows) are moved to start + i."""
    cache = cache.copy()
    cache[start:start + len(path)] = cache[[start + n for n in path]]
    return cache


# ---- unit -------------------------------------------------------------------------------------------------------
def dn_slice(cfg: ModelConfig) -> int:
    return max(d for d in range(1, min(DN_SLICE, cfg.linear_value_head_dim) + 1) if cfg.linear_value_head_dim % d == 0)


def xblocks_in_merge(cfg: ModelConfig) -> bool:
    """Whether tree_attention can write its outputs' XBlocks: a kv head's outputs are whole XBlocks."""
    return cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim % 32 == 0


def norm_heads(cfg: ModelConfig) -> int:
    """The value heads whose gated norms tree_deltanet writes together (tree.cuh: deltanet_norm_heads): 1 where a
    head is whole XBlocks, else the 32 / dv heads of one."""
    dv = cfg.linear_value_head_dim
    return 1 if dv % 32 == 0 else 32 // dv


def dn_smem(cfg: ModelConfig, levels: int, steps: int) -> int:
    """Dynamic shared memory of tree_deltanet for a schedule of `steps` steps using `levels` stack levels
    (templates/tree.cuh: TreeDeltaNetSmem): the levels, or the fronts' raw rows where they are more, then per step
    its gates, sums and front."""
    warps, lane_rows = DN_THREADS // 32, -(-cfg.linear_key_head_dim // 32)
    level = -(-dn_slice(cfg) // warps) * lane_rows * DN_THREADS
    front = 2 * cfg.linear_key_head_dim + dn_slice(cfg)
    raw = (cfg.linear_conv_kernel_dim - 1 + steps) * (front + 2)
    return 4 * (-(-max(levels * level, raw) // 4) * 4 + steps * (8 + 3 + front))


def shape_problem(cfg: ModelConfig, spec: ChipSpec) -> str | None:
    """Why the tree kernels cannot take this model on this chip, or None."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if cfg.head_dim % 32:
        return f"{cfg.name}: head_dim {cfg.head_dim} is not whole 32-value KV blocks"
    if att_threads(cfg) > ATT_MAX_THREADS:
        return (f"{cfg.name}: {group} query heads per kv head need {att_threads(cfg)} threads in the tree attention; "
                f"it takes at most {ATT_MAX_THREADS}")
    dv, hv = cfg.linear_value_head_dim, cfg.linear_num_value_heads
    if not (dv % 32 == 0 or 32 % dv == 0) or hv % norm_heads(cfg):
        return (f"{cfg.name}: DeltaNet value heads of {dv} are neither whole XBlocks of 32 values nor a share of "
                f"{hv} heads' whole XBlocks")
    max_nodes = spec.tuning.ddtree.capacity + 1
    smem = dn_smem(cfg, stack_levels(max_nodes), max_nodes)
    if smem > spec.chip.smem_per_block:
        return f"{spec.name}: the tree DeltaNet stack needs {smem} bytes of shared memory; a block has {spec.chip.smem_per_block}"
    return None


def unit_name(tiled: bool) -> str:
    return "tree_tiled" if tiled else "tree"


def units(spec: ChipSpec, model: ModelConfig, orders: Sequence[bool] = (False, True)) -> list[KernelUnit]:
    """One unit per DeltaNet value-head order in `orders` (True: llama.cpp's tiled order of a GGUF checkpoint,
    False: HF's grouped order)."""
    if not model.linear_layers or not model.full_layers or shape_problem(model, spec):
        return []
    mk, cfg = spec.tuning.megakernel, model
    threads = att_threads(cfg)
    max_nodes = spec.tuning.ddtree.capacity + 1
    hexf = lambda v: float(np.float32(v)).hex() + "f"
    params = dict(
        eps=hexf(cfg.rms_norm_eps), inv_freq=[hexf(v) for v in rope_inv_freq(cfg)],
        lin=dict(hk=cfg.linear_num_key_heads, hv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                 dv=cfg.linear_value_head_dim, conv_k=cfg.linear_conv_kernel_dim, key_dim=cfg.key_dim,
                 value_dim=cfg.value_dim, conv_dim=cfg.conv_dim, slice=dn_slice(cfg)),
        att=dict(nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim, rot=cfg.rotary_dim,
                 min_chunk=att_min_chunk(cfg)),
        dn_threads=DN_THREADS, kv_threads=KV_THREADS, att_threads=threads, att_blocks=mk.blocks, att_rows=att_rows(cfg),
        max_nodes=max_nodes, kv_format=kv_rows(spec, cfg), kv_cls=KV_ROWS[kv_rows(spec, cfg)])
    sigs = (KernelSig("tree_deltanet", DN_THREADS, dynamic_smem=dn_smem(cfg, stack_levels(max_nodes), max_nodes)),
            KernelSig("tree_attention_kv", KV_THREADS), KernelSig("tree_attention", threads),
            KernelSig("tree_kv_commit", KV_THREADS))
    return [KernelUnit(unit_name(tiled), "tree.cu.j2", {**params, "tiled": tiled}, sigs) for tiled in orders]


# ---- launcher ---------------------------------------------------------------------------------------------------
@dataclass
class DeviceTree:
    """A tree on the device: parents, depth and the DeltaNet schedule (views of the launcher's buffers)."""
    n: int
    levels: int  # the DeltaNet stack levels its schedule uses
    parents: np.ndarray
    d_parents: object
    d_depth: object
    d_schedule: object


class TreeKernels:
    """The tree kernels of one model on one chip and their scratch, sized for the spec's largest DDTree (its
    tuning.ddtree.capacity, + root).

    Arguments are DeviceArrays: mixed [N, C + value_dim + 2 Hv] and qkv [N, attention in-projection rows] fp32
    (row stride = their second dimension), out fp32 [N, ...]; weights as lucegen.engine.weights holds them. The
    committed position is `start`, plus io[0] where io (an int32 DeviceArray) is given: the layer-by-layer step
    keeps its position on the device so that its captured graphs replay at any position. A round:
    t = tree(parents) (one upload, shared by every layer), per layer deltanet / attention_kv + attention, then
    set_path(t, path) and per layer deltanet_commit / kv_commit. The decode step is the 1-node tree, uploaded once:
    decode_deltanet and decode_attention, one launch each (its K/V row is row start: nothing to commit). Uploads go
    into fixed buffers: on the stream of the launches (pageable copies: the host array may go at once), or
    synchronous copies, when a round's launches must be done before the next tree() or set_path()."""

    def __init__(self, module, cfg: ModelConfig, spec: ChipSpec):
        from ..runtime import DeviceArray
        self.cfg, self.spec = cfg, spec
        mk = spec.tuning.megakernel
        self.max_nodes = spec.tuning.ddtree.capacity + 1
        self.att_blocks, self.att_threads = mk.blocks, att_threads(cfg)
        self._dn, self._kv = module.kernel("tree_deltanet"), module.kernel("tree_attention_kv")
        self._att, self._commit = module.kernel("tree_attention"), module.kernel("tree_kv_commit")
        smem = dn_smem(cfg, stack_levels(self.max_nodes), self.max_nodes)
        if smem > 48 * 1024:
            self._dn.set_max_dynamic_smem(smem)
        chunks, group = max(1, mk.blocks // cfg.num_key_value_heads), cfg.num_attention_heads // cfg.num_key_value_heads
        part = self.max_nodes * cfg.num_key_value_heads * chunks * group
        self.part_ml = DeviceArray.empty(part * 2, np.float32)
        self.part_acc = DeviceArray.empty(part * cfg.head_dim, np.float32)
        # the attention merges' tickets, then the DeltaNet's: one a layer (path commits run side by side)
        self.tickets = DeviceArray.zeros(self.max_nodes * cfg.num_key_value_heads + cfg.num_hidden_layers, np.uint32)
        self.norm_tickets = DeviceArray.zeros(cfg.linear_num_value_heads // norm_heads(cfg), np.uint32)
        # [parents | depth | schedule | path] of a round's tree, then of the 1-node tree
        self.ints = DeviceArray.empty(4 * self.max_nodes + 3, np.int32)
        self.ints.view(3, np.int32, 16 * self.max_nodes).copy_from(np.array([-1, 0, 0], np.int32))
        self.single = self._views(1, 0, [-1], 4 * self.max_nodes, 1)
        self.path = self.ints.view(self.max_nodes, np.int32, 12 * self.max_nodes)

    def _views(self, n: int, levels: int, parents, first: int, stride: int) -> DeviceTree:
        at = lambda i: self.ints.view(n, np.int32, 4 * (first + i * stride))
        return DeviceTree(n, levels, np.asarray(parents, np.int32), at(0), at(1), at(2))

    def tree(self, parents: Sequence[int], stream=None) -> DeviceTree:
        """Upload a round's tree (validated; at most the budget + 1 nodes); on `stream`, in order with the
        launches there, else a synchronous copy."""
        if len(parents) > self.max_nodes:
            raise ValueError(f"tree: {len(parents)} nodes; {self.spec.name}'s kernels take at most {self.max_nodes} "
                             f"(the spec's largest DDTree, {self.max_nodes - 1}, + root)")
        depth = depths(parents)
        codes, levels = schedule(parents)
        t = self._views(len(parents), levels, parents, 0, self.max_nodes)
        for view, a in ((t.d_parents, t.parents), (t.d_depth, depth), (t.d_schedule, codes)):
            view.copy_from(a, stream=stream)
        return t

    def set_path(self, tree: DeviceTree, path: Sequence[int], stream=None) -> int:
        """Upload the accepted path (root first) for the commits (on `stream` as tree()); returns its length."""
        check_path(tree.parents, path)
        self.path.view(len(path), np.int32).copy_from(np.asarray(path, np.int32), stream=stream)
        return len(path)

    def _deltanet(self, tree, mixed, conv_w, a_log, dt_bias, ring, state, out, start, io, steps, levels, codes,
                  commit, stream, norm=None, layer=0):
        cfg = self.cfg
        grid = (cfg.linear_num_value_heads, cfg.linear_value_head_dim // dn_slice(cfg))
        ticket = self.tickets.view(1, np.uint32, 4 * (self.max_nodes * cfg.num_key_value_heads + layer))
        w, normed, normed_q = norm or (NULL, NULL, NULL)
        self._dn(grid, DN_THREADS, mixed, mixed.shape[1], conv_w, a_log, dt_bias, ring, state, tree.d_parents,
                 tree.d_depth, codes, tree.n, steps, levels, _io(io), start, out, ticket, commit, w, normed,
                 NULL if normed_q is None else normed_q, self.norm_tickets, smem=dn_smem(cfg, levels, steps),
                 stream=stream)

    def deltanet(self, tree: DeviceTree, mixed, conv_w, a_log, dt_bias, ring, state, out, start: int, io=None,
                 stream=None, norm=None) -> None:
        """Raw head outputs out [N, Hv * dv] of every node; the committed ring and state are only read. norm = (w,
        normed, normed_q): also normed [N, Hv * dv] = the gated RMSNorm (weight w, gate z from mixed) of out, and its
        XBlocks into normed_q (None: none)."""
        self._deltanet(tree, mixed, conv_w, a_log, dt_bias, ring, state, out, start, io, tree.n, tree.levels,
                       tree.d_schedule, VERIFY, stream, norm)

    def deltanet_commit(self, tree: DeviceTree, length: int, mixed, conv_w, a_log, dt_bias, ring, state, out,
                        start: int, io=None, stream=None, layer: int = 0) -> None:
        """The accepted path (set_path) replayed into ring and state of layer `layer`: they become what decoding its
        tokens one by one leaves. out rows of the path's nodes are rewritten with the same values. The kernel does
        not wait for the one before: its inputs come from the verify, which set_path's upload on the stream follows
        (and so do the path's kv_commit), so the layers' commits run side by side."""
        self._deltanet(tree, mixed, conv_w, a_log, dt_bias, ring, state, out, start, io, length, 0, self.path,
                       PATH_COMMIT, stream, layer=layer)

    def decode_deltanet(self, mixed, conv_w, a_log, dt_bias, ring, state, out, start: int, io=None,
                        stream=None, norm=None) -> None:
        """The decode step at position start: out [1, Hv * dv]; ring and state advanced; norm as deltanet's."""
        t = self.single
        self._deltanet(t, mixed, conv_w, a_log, dt_bias, ring, state, out, start, io, 1, 0, t.d_schedule,
                       STEP_COMMIT, stream, norm)

    def attention_kv(self, tree: DeviceTree, qkv, k_norm, keys, values, start: int, io=None, stream=None) -> None:
        """Node n's K/V rows into cache rows start + n (the cache must hold start + N rows)."""
        self._kv((tree.n, self.cfg.num_key_value_heads), KV_THREADS, qkv, qkv.shape[1], k_norm, keys, values,
                 tree.d_depth, _io(io), start, stream=stream)

    def _attention(self, tree, qkv, q_norm, k_norm, keys, values, out, start, io, writes_kv, stream,
                   out_q=None) -> None:
        self._att((self.att_blocks, tree.n), self.att_threads, qkv, qkv.shape[1], q_norm, k_norm, keys, values,
                  tree.d_parents, tree.d_depth, _io(io), start, self.part_ml, self.part_acc, self.tickets, out,
                  int(writes_kv), NULL if out_q is None else out_q, stream=stream)

    def attention(self, tree: DeviceTree, qkv, q_norm, keys, values, out, start: int, io=None,
                  stream=None, out_q=None) -> None:
        """Gated attention outputs out [N, n_heads * head_dim]; after attention_kv. out_q: their XBlocks too (where
        a kv head's outputs are whole XBlocks: xblocks_in_merge)."""
        self._attention(tree, qkv, q_norm, NULL, keys, values, out, start, io, False, stream, out_q)  # K/V written

    def decode_attention(self, qkv, q_norm, k_norm, keys, values, out, start: int, io=None, stream=None,
                         out_q=None) -> None:
        """The decode step at position start in one launch: its K/V row into row start, out [1, n_heads * head_dim]
        (and its XBlocks into out_q, as attention's)."""
        self._attention(self.single, qkv, q_norm, k_norm, keys, values, out, start, io, True, stream, out_q)

    def kv_commit(self, length: int, keys, values, start: int, io=None, stream=None) -> None:
        """The accepted path's rows (set_path) moved to start .. start + length - 1 (no wait for the kernel before,
        as deltanet_commit)."""
        self._commit(self.cfg.num_key_value_heads, KV_THREADS, keys, values, self.path, length, _io(io), start,
                     stream=stream)

    def free(self) -> None:
        for a in (self.part_ml, self.part_acc, self.tickets, self.norm_tickets, self.ints):
            a.free()
