"""The keys of tapes (:mod:`simddp.cosim.tape`): what a backward pass, a module call or an
optimizer step must share with a recorded one for its tape to hold its ops.

A backward's key is its autograd graph walked from the roots (see :func:`graph_key`); a
confirmed module call's subgraph is keyed by the call (:func:`note_subgraph`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch

from ..compat import AccumulateGrad, SavedTensor

if TYPE_CHECKING:
    from .clock import RankClock

_ACCUMULATE = AccumulateGrad
_PY_NODE = torch.autograd.function.BackwardCFunction
_SAVED_TENSOR = SavedTensor
TENSORS = (torch.Tensor, torch.nn.Parameter)
SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device,
                      torch.layout, torch.memory_format})
_SUBGRAPH_LIMIT = 64  # module subgraphs noted per rank between backward passes


class Ineligible(Exception):
    pass


# -- the key ---------------------------------------------------------------------------------
_attrs: dict[type, Any] = {}  # node class -> a getter of its saved attributes (raw if tensor)


def _saved_getter(node: Any) -> Any:
    names = []
    for a in dir(node):
        if a.startswith("_saved_"):
            raw = "_raw" + a
            names.append(raw if hasattr(node, raw) else a)
    if not names:
        return lambda n: ()
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda n: (get(n),)


def _meta(v: Any) -> Any:
    """A saved value as the key holds it: tensors by layout, never unpacked."""
    c = v.__class__
    if c in SCALARS:
        return (c, v)  # 1, 1.0 and True are distinct here
    if c is _SAVED_TENSOR:
        if v.unpack_hook is not None:
            raise Ineligible  # saved-tensor hooks (checkpointing, offloading): Python code
        t = v.data
        return None if t is None else (t.shape, t.dtype, t.stride(), t.layout)
    if c is tuple or c is list:
        types = tuple(map(type, v))  # (sizes, strides: ints; the types keep 1 and 1.0 apart)
        return (c, types, tuple(v)) if SCALARS.issuperset(types) else \
            (c, *[_meta(x) for x in v])
    if c in TENSORS:
        return t_meta(v)
    raise Ineligible  # SymInts, opaque objects


def t_meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.stride(), t.layout, t.requires_grad)


def _leaf(node: Any) -> tuple:
    """An AccumulateGrad node: its parameter and the state of its ``.grad``."""
    return leaf_state(node.variable)


def leaf_state(v: torch.Tensor) -> tuple:
    """A leaf tensor (a parameter) and the state of its ``.grad``."""
    if v._backward_hooks or getattr(v, "_post_accumulate_grad_hooks", None):
        raise Ineligible
    g = v.grad
    return (id(v), v.shape, v.dtype, v.stride(), None if g is None else t_meta(g))


def graph_key(roots: list, subs: dict | None = None) -> tuple:
    """The key of a backward from ``roots`` (nodes): raises Ineligible where there is none.
    ``subs``: output node -> (key, leaves, outward edges) of the subgraphs that module calls
    replayed from confirmed tapes built (see :func:`note_subgraph`)."""
    index: dict = {}
    nodes: list = []
    edges: list = []
    stack = roots[::-1]
    while stack:
        n = stack.pop()
        if n is None or n in index:
            continue
        index[n] = len(nodes)
        sub = subs.get(n) if subs else None
        if sub is not None:  # a confirmed module forward's subgraph: its key stands for it
            skey, leaves, nf = sub
            nodes.append(("module", skey, *map(leaf_state, leaves)))
            edges.append(nf)
            stack += [c for c, _ in nf[::-1]]
            continue
        nf = n.next_functions
        cls = n.__class__
        if cls is _ACCUMULATE:
            nodes.append(_leaf(n))
        elif isinstance(n, _PY_NODE):
            raise Ineligible  # a Python autograd Function: its backward is arbitrary code
        else:
            get = _attrs.get(cls)
            if get is None:
                get = _attrs[cls] = _saved_getter(n)
            try:
                saved = tuple(map(_meta, get(n)))
            except RuntimeError:  # freed saved tensors: the backward will say so, per-op
                raise Ineligible from None
            nodes.append((cls, *saved, *[(*m.shape, m.dtype) for m in n._input_metadata]))
        edges.append(nf)
        if nf:
            stack += [c for c, _ in nf[::-1]]
    get = index.get
    return (*nodes, *[(*[(get(c, -1), i) for c, i in nf],) for nf in edges])


def backward_key(r: "RankClock", t_outputs: Any, args: tuple, kwargs: dict) -> tuple:
    if len(args) != 4 or args[3] or len(kwargs) > 2:  # inputs=: which nodes run is not in
        raise Ineligible                                # the graph
    grads, retain, create, _inputs = args
    allow, acc = kwargs.get("allow_unreachable"), kwargs.get("accumulate_grad")
    if len(kwargs) != (allow is not None) + (acc is not None):
        raise Ineligible
    roots = []
    for t in t_outputs:
        fn = getattr(t, "grad_fn", None)
        if fn is None:
            raise Ineligible
        roots.append(fn)
    gk = tuple([None if g is None else t_meta(g) for g in grads])
    return (bool(retain), bool(create), allow, acc, gk, tuple(r.fwd_context),
            graph_key(roots, r.subgraphs))


def note_subgraph(r: "RankClock", out: Any, key: tuple, leaves: list, args: tuple) -> None:
    """A module call ran ops its confirmed tape holds (the same ops as every call under
    ``key``): the autograd subgraph under ``out`` is a function of ``key`` and of the
    ``.grad`` state of ``leaves``, and it points out of itself only at the arguments'
    gradient edges. The next backward's key walks ``key`` instead of that subgraph."""
    edges = []  # (node, input_nr), as in next_functions
    for a in args:
        if not a.requires_grad:
            edges.append((None, 0))
        elif a.grad_fn is None:
            return  # a leaf argument: its AccumulateGrad node is not at hand without an op
        else:
            edges.append((a.grad_fn, a.output_nr))
    subs = r.subgraphs
    if len(subs) >= _SUBGRAPH_LIMIT:
        subs.clear()
    subs[out.grad_fn] = (key, leaves, tuple(edges))
