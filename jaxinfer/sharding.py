"""Device meshes and the one table that maps logical axis names to mesh axes.

Every parameter is declared with logical axis names (`model.param_axes`); the KV cache and the step
batch have theirs here. `RULES` maps each logical name to a mesh axis (or None: replicated), and
`spec_for` turns a tensor's logical names into a PartitionSpec for a given mesh:

- a logical name whose mesh axis does not divide that dimension is replicated instead (e.g. 2 KV
  heads on a 4-way `model` axis: every device holds both; never dropped, never split mid-head);
- two dimensions of one tensor may not map to the same mesh axis: that is a broken table, refused
  with an error naming the tensor and the names.

Tensor parallelism runs over `model` (query/KV heads, MLP intermediate, vocabulary); data
parallelism over `data` (batch rows). The KV page pools are shared by every sequence, so they shard
over KV heads only and are replicated over `data`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling_params import is_int

MESH_AXES = ("data", "model")

# logical axis name -> mesh axis (None: replicated)
RULES: Mapping[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "embed": None,
    "q_heads": "model",
    "kv_heads": "model",
    # The fused q/k/v heads of a model in float32 strips (model.qkv_fused), which run on one CPU
    # device only: splitting them over "model" would mix q and k/v heads, so never sharded.
    "qkv_heads": None,
    "head_dim": None,
    "mlp": "model",
    "norm": None,
    "pages": None,
    "page_slots": None,
}


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int | None = None) -> dict[str, int]:
    """'data=2,model=4' (or a dict) -> {'data': 2, 'model': 4}; a missing axis has size 1.

    One process may use the first data x model of its `num_devices` devices (default: all devices
    of the backend); a multi-process mesh must span all of them, since every process takes part.
    """
    num_devices = num_devices or jax.device_count()
    if spec is None:
        return {"data": 1, "model": 1}
    if isinstance(spec, str):
        sizes: dict[str, int] = {}
        for part in spec.split(","):
            name, sep, value = (x.strip() for x in part.partition("="))
            if not sep or not name:
                raise InvalidRequestError(f"mesh must look like 'data=2,model=4', got {spec!r}")
            if name in sizes:
                raise InvalidRequestError(f"mesh names axis {name!r} twice in {spec!r}")
            # ASCII digits only: str.isdigit() also takes '²', which int() then refuses.
            sizes[name] = int(value) if re.fullmatch(r"-?[0-9]+", value) else value
    else:
        sizes = dict(spec)
    for name, size in sizes.items():
        if name not in MESH_AXES:
            raise InvalidRequestError(f"mesh axis {name!r} is not one of {MESH_AXES}")
        if not is_int(size) or size < 1:
            raise InvalidRequestError(f"mesh axis {name!r} must be a positive integer, got {size!r}")
    sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}  # NumPy integers too, as elsewhere
    total = math.prod(sizes.values())
    if total > num_devices:
        available = f"only {num_devices} is" if num_devices == 1 else f"only {num_devices} are"
        raise InvalidRequestError(f"mesh {format_mesh(sizes)} has {total} devices; {available} available")
    if total != num_devices and jax.process_count() > 1:
        raise InvalidRequestError(
            f"mesh {format_mesh(sizes)} has {total} devices; a multi-process mesh must span all {num_devices} "
            f"devices of the {jax.process_count()} processes"
        )
    return sizes


def format_mesh(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES)


def make_mesh(spec: str | Mapping[str, int] | None, devices: Sequence | None = None) -> Mesh:
    """A (data, model) Mesh over the first data x model of `devices` (default: all devices), model
    the fastest-varying axis so that tensor-parallel peers are neighbours."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, len(devices))
    grid = np.array(devices[: sizes["data"] * sizes["model"]], dtype=object).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, MESH_AXES)


def spec_for(name: str, logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Mapping = RULES) -> P:
    """The PartitionSpec of one tensor: its logical names through the rules, replicated where the
    mesh axis does not divide the dimension. Raises on a name missing from the rules or on two
    dimensions mapped to one mesh axis."""
    if len(logical) != len(shape):
        raise ValueError(f"{name}: {len(logical)} logical axes for a tensor of rank {len(shape)}")
    out, used = [], {}
    for axis_name, size in zip(logical, shape):
        if axis_name is None:
            out.append(None)
            continue
        if axis_name not in rules:
            raise ValueError(f"{name}: logical axis {axis_name!r} has no entry in the sharding rules")
        mesh_axis = rules[axis_name]
        if mesh_axis is not None and mesh_axis in used:
            raise ValueError(
                f"{name}: logical axes {used[mesh_axis]!r} and {axis_name!r} both map to mesh axis "
                f"{mesh_axis!r} (a tensor can be split over a mesh axis only once)"
            )
        if mesh_axis is not None:
            used[mesh_axis] = axis_name
        divides = mesh_axis is not None and size % mesh.shape[mesh_axis] == 0
        out.append(mesh_axis if divides and mesh.shape[mesh_axis] > 1 else None)
    return P(*out)


def check_rules(rules: Mapping[str, str | None] = RULES) -> None:
    """Every rule targets a mesh axis that exists (or None)."""
    for logical, axis in rules.items():
        if axis is not None and axis not in MESH_AXES:
            raise ValueError(f"rule {logical!r} -> {axis!r}: {axis!r} is not a mesh axis {MESH_AXES}")


def param_shardings(cfg, mesh: Mesh, rules: Mapping = RULES):
    """NamedShardings for every parameter, from the logical names declared in the model."""
    from jaxinfer.model import abstract_params, param_axes

    check_rules(rules)
    axes = param_axes(cfg)
    shapes = abstract_params(cfg)
    paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, P))
    out = [
        NamedSharding(mesh, spec_for(jax.tree_util.keystr(path), tuple(spec), leaf.shape, mesh, rules))
        for (path, leaf), spec in zip(paths, specs, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(shapes), out)


def kv_head_copies(cfg, mesh: Mesh) -> int:
    """How many times to store each KV head so that every `model` device holds only the heads its own
    query heads read.

    K KV heads cannot be split over a `model` axis of M > K devices, and plain replication leaves the
    whole KV cache on every device: it would stop shrinking as the mesh grows. When M is a multiple of
    K (and N of M), each head is stored M / K times instead; the axis then splits the copies, and
    device i holds one: the head of its N / M query heads. The cache per device keeps shrinking with
    M (in all it grows M / K-fold). The answers are unchanged: a copy holds the same numbers.
    """
    m = dict(mesh.shape).get("model", 1)
    k, n = cfg.num_kv_heads, cfg.num_heads
    return m // k if k < m and m % k == 0 and n % m == 0 else 1


_KV_WEIGHTS = ("wk", "wv", "bk", "bv")  # their KV-head axis is the second to last


def place_params(cfg, params, mesh: Mesh, rules: Mapping = RULES):
    """(cfg, params) placed on the mesh by the rules, KV heads copied `kv_head_copies` times first
    (the returned cfg then has that many more KV heads; the K/V weights and biases are repeated so
    that copy j of the widened axis is head j // copies)."""
    copies = kv_head_copies(cfg, mesh)
    if copies == 1:
        return cfg, jax.device_put(params, param_shardings(cfg, mesh, rules))
    wide = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * copies)

    def widen(path, x):  # wk, wv [D, K, H]; bk, bv [K, H]
        name = getattr(path[-1], "key", None)
        return jnp.repeat(x, copies, axis=x.ndim - 2) if name in _KV_WEIGHTS else x

    shardings = param_shardings(wide, mesh, rules)
    return wide, jax.jit(lambda p: jax.tree_util.tree_map_with_path(widen, p), out_shardings=shardings)(params)


def narrow_kv_heads(params, copies: int):
    """`place_params`' widening undone: one of each KV head's `copies` copies (the others' arrays are
    the params' own)."""

    def narrow(path, x):
        if getattr(path[-1], "key", None) not in _KV_WEIGHTS:
            return x
        return jax.lax.slice_in_dim(x, 0, x.shape[-2], copies, axis=x.ndim - 2)

    return jax.tree_util.tree_map_with_path(narrow, params)


def cache_shardings(cache, mesh: Mesh, rules: Mapping = RULES):
    """Shardings of a KVCache (or its abstract shapes): pools [K, P, S, H] and int8 scales [K, P, S]
    over KV heads."""
    check_rules(rules)

    def one(x):
        names = ("kv_heads", "pages", "page_slots", "head_dim")[: len(x.shape)]
        return NamedSharding(mesh, spec_for("kv_cache", names, x.shape, mesh, rules))

    return jax.tree.map(one, cache)


def batch_shardings(batch, mesh: Mesh, rules: Mapping = RULES):
    """Shardings of a step's Batch: every array's leading (row) axis over `data` when it divides."""

    def one(x):
        names = ("batch",) + (None,) * (len(x.shape) - 1)
        return NamedSharding(mesh, spec_for("batch", names, x.shape, mesh, rules))

    return jax.tree.map(one, batch)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_bytes(tree, shardings=None) -> dict:
    """{device: bytes} the arrays of `tree` (or their abstract shapes, with `shardings`) put on every
    device of their mesh, every process's included: a dimension split over an axis counts its slice,
    a replicated one counts whole on each device that holds it."""
    out: dict = {}
    leaves = jax.tree.leaves(tree)
    shardings = [x.sharding for x in leaves] if shardings is None else jax.tree.leaves(shardings)
    for leaf, sh in zip(leaves, shardings, strict=True):
        for device, index in sh.devices_indices_map(leaf.shape).items():
            n = math.prod(len(range(*sl.indices(d))) for sl, d in zip(index, leaf.shape))
            out[device] = out.get(device, 0) + n * leaf.dtype.itemsize
    return out


def bytes_per_device(tree) -> dict[str, int]:
    """{device name: bytes} held by the arrays of `tree` on this process's devices."""
    return {str(d): b for d, b in shard_bytes(tree).items() if d.process_index == jax.process_index()}
