"""The control-flow lowering rules of the Mosaic GPU backend (registered in
:data:`pallas_mosaic_gpu.registry.RULES`): calls, ``cond``, loops, ``run_scoped``, program and
axis indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, scf

from pallas_core import backend as plb
from pallas_core.backend import PallasError, mlir_element_type
from pallas_mosaic_gpu import warp_specialized_lowering
from pallas_mosaic_gpu.params import ACC_SPACE
from pallas_mosaic_gpu.registry import lower_jaxpr, rule
from pallas_mosaic_gpu.values import (
    FA,
    GPULowering,
    Ref,
    changing_layout,
    emit_for,
    i32,
    index,
    literal,
    relaid_carry,
    relayout,
    signed,
)

# --- control flow ----------------------------------------------------------------------------


@rule(plb.program_id_p)
def _program_id(state: GPULowering, eqn: Any, *, axis: int, **_: Any) -> Any:
    return state.program_ids[axis]


@rule(plb.axis_index_p)
def _axis_index(state: GPULowering, eqn: Any, *, axis_name: Any, **_: Any) -> Any:
    name = axis_name[0] if isinstance(axis_name, tuple) and len(axis_name) == 1 else axis_name
    if name not in state.axes and name in dict(state.devices):
        from pallas_mosaic_gpu.rules_devices import device_index
        return device_index(state, name)  # a shard_map axis: this device's coordinate
    if name not in state.axes:
        raise state.fail(f"jax.lax.axis_index({name!r}) (the kernel's axes are "
                         f"{sorted(state.axes)})")
    return state.axes[name]


@rule(*plb.CALL_PRIMITIVES, lazy=True)
def _call(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    jaxpr, consts = plb.called_jaxpr(eqn)
    return lower_jaxpr(state, jaxpr, consts, args)


@rule(plb.cond_p, lazy=True)
def _cond(state: GPULowering, eqn: Any, pred: Any, *args: Any, branches: Any, **_: Any) -> Any:
    pred = state.value(pred)
    if isinstance(pred, FA):
        raise state.fail("a branch on an array")
    taken = warp_specialized_lowering.static_predicate(pred)
    if taken is not None:  # a branch known here (warpgroups_run_concurrently): only it
        branch = branches[min(max(taken, 0), len(branches) - 1)]
        return lower_jaxpr(state, branch.jaxpr, branch.consts, args)
    keys = sorted(state.accs)
    before = {k: state.accs[k] for k in keys}
    avals = [v.aval for v in eqn.outvars]

    # The selector, computed once for the draft and the conditional below.
    if len(branches) == 2:
        selector = arith.cmpi(arith.CmpIPredicate.ne, i32(pred) if not isinstance(
            pred.type, ir.IntegerType) or ir.IntegerType(pred.type).width != 1 else
            arith.extui(ir.IntegerType.get_signless(32), pred), i32(0))
    else:
        selector = index(i32(pred))

    def make(types: list[ir.Type]) -> tuple[Any, list[Any]]:
        if len(branches) == 2:
            op = scf.IfOp(selector, types, has_else=True)
            return op, [op.else_block, op.then_block]
        # lax.switch: an scf.index_switch, as JAX lowers it (the last branch its default)
        op = scf.IndexSwitchOp(types, selector, range(len(branches) - 1))
        regions = list(op.regions)
        return op, [r.blocks[0] for r in (*regions[1:], regions[0])]

    # The branches are lowered into a draft without results first: what they yield (arrays
    # as their registers, in the layouts the branches give them; the accumulators) is known
    # only then. Their operations then move into the operation that has those results.
    draft, blocks = make([])
    produced = []
    for block, branch in zip(blocks, branches, strict=True):
        with ir.InsertionPoint(block):
            for k in keys:
                state.accs[k] = before[k]
            outs = lower_jaxpr(state, branch.jaxpr, branch.consts, args)
            outs = [v if isinstance(v, (ir.Value, FA)) else literal(v, a)
                    for v, a in zip((state.value(o) for o in outs), avals)]
            produced.append([*outs, *(state.accs[k] for k in keys)])
    for j in range(len(avals)):  # a splat takes the layout another branch gives the output
        found = [p[j].layout for p in produced if isinstance(p[j], FA)
                 and not isinstance(p[j].layout, mgpu.WGSplatFragLayout)]
        for block, p in zip(blocks, produced):
            if found and isinstance(p[j], FA) and p[j].layout != found[0]:
                with ir.InsertionPoint(block):
                    p[j] = relayout(p[j], found[0])
    flat = [jax.tree_util.tree_flatten(p) for p in produced]
    if any(tree != flat[0][1] for _, tree in flat):  # type: ignore[operator]
        raise state.fail("a conditional whose branches return arrays in different layouts")
    op, final = make([leaf.type for leaf in flat[0][0]])
    for block, into, (leaves, _) in zip(blocks, final, flat, strict=True):
        with ir.InsertionPoint(into):
            end = scf.YieldOp(leaves)
        for inner in list(block.operations):
            inner.move_before(end)
    draft.operation.erase()
    done = jax.tree_util.tree_unflatten(flat[0][1], list(op.results))
    for k, v in zip(keys, done[len(avals):]):
        state.accs[k] = v
    return done[:len(avals)]


@rule(plb.scan_p, lazy=True)
def _scan(state: GPULowering, eqn: Any, *args: Any, jaxpr: Any, length: int,
          reverse: bool, **_: Any) -> Any:
    consts, carry, xs, split_out = plb.scan_parts(eqn.params, args)
    if xs or reverse:
        raise state.fail("lax.scan over arrays or reversed (use lax.fori_loop)")
    carry = [state.value(c) for c in carry]

    def body(i: ir.Value, vals: list[Any]) -> list[Any]:
        outs, ys = split_out(lower_jaxpr(state, jaxpr.jaxpr, jaxpr.consts, [*consts, *vals]))
        if ys:
            raise state.fail("lax.scan with stacked outputs")
        return outs

    return emit_for(state, length, carry, body)


@rule(plb.while_p, lazy=True)
def _while(state: GPULowering, eqn: Any, *args: Any, cond_jaxpr: Any, body_jaxpr: Any,
           cond_nconsts: int, body_nconsts: int, **_: Any) -> Any:
    cconsts = args[:cond_nconsts]
    bconsts = args[cond_nconsts:cond_nconsts + body_nconsts]
    init = [state.value(a) for a in args[cond_nconsts + body_nconsts:]]
    # fori_loop(lo, hi, f, x) with dynamic bounds: (i, hi, x) carried, i < hi tested.
    cj = cond_jaxpr.jaxpr
    fori = (len(cj.eqns) == 1 and cj.eqns[0].primitive is lax.lt_p and not cconsts
            and cj.eqns[0].invars[0] is cj.invars[0] and cj.eqns[0].invars[1] is cj.invars[1])
    if not fori:
        return _general_while(state, eqn, cconsts, bconsts, init, cond_jaxpr, body_jaxpr)
    lo, hi, rest = init[0], init[1], init[2:]

    def body(i: ir.Value, vals: list[Any]) -> list[Any]:
        outs = lower_jaxpr(state, body_jaxpr.jaxpr, body_jaxpr.consts,
                           [*bconsts, i, hi, *vals])
        return outs[2:]

    n = arith.maxsi(arith.subi(i32(hi), i32(lo)), i32(0))
    outs = emit_for(state, n, rest, body, start=lo)
    return [arith.maxsi(i32(hi), i32(lo)), hi, *outs]


def _general_while(state: GPULowering, eqn: Any, cconsts: Sequence[Any],
                   bconsts: Sequence[Any], init: list[Any], cond_jaxpr: Any,
                   body_jaxpr: Any) -> list[Any]:
    """A ``lax.while_loop`` as an ``scf.while`` carrying its values and every accumulator,
    arrays as their registers, as JAX lowers it (plgpu.dynamic_scheduling_loop's loop over
    claimed grid points is one). Carried splats take the layout the body gives them."""
    avals = [v.aval for v in eqn.outvars]
    keys = sorted(state.accs)
    init = [v if isinstance(v, (ir.Value, FA)) else literal(v, a)
            for v, a in zip((state.value(v) for v in init), avals)]

    def enter(values: Any, tree: Any) -> list[Any]:
        inner = jax.tree_util.tree_unflatten(tree, list(values))
        for k, v in zip(keys, inner[:len(keys)]):
            state.accs[k] = v
        return list(inner[len(keys):])

    for _attempt in range(3):
        leaves, tree = jax.tree_util.tree_flatten([*(state.accs[k] for k in keys), *init])
        types = [leaf.type for leaf in leaves]
        op = scf.WhileOp(types, leaves)
        head = op.before.blocks.append(*types)
        with ir.InsertionPoint(head):
            (go,) = lower_jaxpr(state, cond_jaxpr.jaxpr, cond_jaxpr.consts,
                                [*cconsts, *enter(head.arguments, tree)])
            scf.ConditionOp(state.value(go), list(head.arguments))
        loop = op.after.blocks.append(*types)
        with ir.InsertionPoint(loop):
            outs = lower_jaxpr(state, body_jaxpr.jaxpr, body_jaxpr.consts,
                               [*bconsts, *enter(loop.arguments, tree)])
            outs = [v if isinstance(v, (ir.Value, FA)) else literal(v, a)
                    for v, a in zip((state.value(o) for o in outs), avals)]
            out_leaves, out_tree = jax.tree_util.tree_flatten(
                [*(state.accs[k] for k in keys), *outs])
            same = bool(out_tree == tree)  # type: ignore[operator]
            if same:
                scf.YieldOp(out_leaves)
        if same:
            return enter(op.results, tree)
        op.operation.erase()
        init = relaid_carry(init, outs)
    raise changing_layout(state)


@rule(plb.run_scoped_p, lazy=True)
def _run_scoped(state: GPULowering, eqn: Any, *consts: Any, jaxpr: Any, scoped: Any,
                **_: Any) -> Any:
    warp_specialized_lowering.enter_run_scoped(state, eqn)
    refs = []
    allocated = state.scoped.get(id(eqn))
    if allocated is None:
        raise PallasError("internal: a pl.run_scoped the shared-memory plan did not see")
    for n, mref in enumerate(scoped):
        if mref.memory_space is ACC_SPACE:
            key = id(eqn) * 100 + n
            state.accs[key] = mgpu.WGMMAAccumulator.zero(*mref.shape,
                                                         mlir_element_type(mref.dtype),
                                                         is_signed=signed(mref.dtype))
            refs.append(Ref("acc", tuple(mref.shape), mref.dtype, acc_key=key))
        else:
            refs.append(allocated[n])
    outs = lower_jaxpr(state, jaxpr.jaxpr, jaxpr.consts, [*consts, *refs])
    for r in refs:
        state.accs.pop(r.acc_key, None)
    return outs


@rule(plb.multiple_of_p)
def _multiple_of(state: GPULowering, eqn: Any, x: Any, **_: Any) -> Any:
    return x
