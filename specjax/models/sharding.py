"""Device meshes (design §10): tensor and data parallelism with `jax.sharding`, several hosts with
`jax.distributed`.

A mesh has two named axes, `data` (batch rows) and `model` (tensor parallel: attention heads, MLP
hidden, the vocabulary of the embedding and LM head). Nothing here knows a model: each model family
declares its layout as one table beside its code (`transformer.PARTITION_RULES`,
`hybrid.PARTITION_RULES`; a drafter's `Drafter.partition_rules`), and its cache layout as
`cache_partition(cache)`. A rule is (regex, PartitionSpec), searched in the parameter's path
("layers/0/self_attn/q_proj/weight"); the first match wins, no match is replicated.

    mesh = sharding.make_mesh(data=2, model=4)          # or sharding.parse_mesh("data=2,model=4")
    result = specjax.generate(model, prompts, drafters=[d], mesh=mesh)

Every spec is *fitted* to the array it lands on: an axis that does not divide the dimension (a
vocabulary of 160 over 3 devices, 2 KV heads over 8) is dropped from that dimension, which then is
replicated over it. A sharding never changes what is computed, only where it lives and which
collectives XLA inserts (a sum split over devices adds in another order: float rounding, nothing
more); so correctness never rests on a table, and a table is judged by speed (on one CPU, a
simulated mesh measures nothing but overhead).

Inside a traced program `constrain` pins a pytree to its specs when a mesh is in context
(`jax.set_mesh`, which `generate(mesh=...)` and the trainers' `--mesh` enter) and does nothing
otherwise, so the one-device programs are unchanged. `place` puts host values on a mesh, also when
the mesh spans processes (`jax.make_array_from_callback`: each process supplies the shards of its
own devices; every process passes the same value).

Multi-process: `initialize_distributed()` calls `jax.distributed.initialize` from the environment
(SPECJAX_COORDINATOR, SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID; on CPU the gloo collectives).
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.models import kvcache

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
REPLICATED = P()
BATCH = P(DATA)  # batch-major arrays: rows over `data`, the rest replicated

Rules = Sequence[tuple[str, P]]


# ----------------------------------------------------------------------------- meshes

def parse_mesh_shape(text: str) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "model": 4} (an axis left out has size 1). ValueError on
    anything else: unknown axis names, repeated axes, sizes that are not positive integers."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a mesh is written data=D,model=M (e.g. data=2,model=4)")
    shape = {DATA: 1, MODEL: 1}
    seen = set()
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise ValueError(f"mesh {text!r}: expected axes {DATA}=D,{MODEL}=M, got {part.strip()!r}")
        if name in seen:
            raise ValueError(f"mesh {text!r}: axis {name!r} given twice")
        seen.add(name)
        try:
            n = int(size)
        except ValueError:
            raise ValueError(f"mesh {text!r}: the size of {name!r} must be a positive integer, got {size!r}") from None
        if n < 1:
            raise ValueError(f"mesh {text!r}: the size of {name!r} must be a positive integer, got {n}")
        shape[name] = n
    return shape


def make_mesh(data: int = 1, model: int = 1, devices: Sequence | None = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: every device of every process). Their number must
    be data * model: ValueError otherwise."""
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        raise ValueError(f"a mesh of data={data} x model={model} needs {data * model} devices; "
                         f"{len(devices)} are available"
                         + (" (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported)"
                            if devices and devices[0].platform == "cpu" else ""))
    if len(devices) == len(jax.devices()):  # the device order that suits the interconnect
        return jax.make_mesh((data, model), AXES, devices=devices, axis_types=(AxisType.Auto,) * 2)
    return Mesh(np.asarray(devices).reshape(data, model), AXES, axis_types=(AxisType.Auto,) * 2)


def parse_mesh(text: str, devices: Sequence | None = None) -> Mesh:
    """`make_mesh` from "data=D,model=M"."""
    return make_mesh(**parse_mesh_shape(text), devices=devices)


def check_mesh(mesh) -> Mesh:
    """The mesh, checked (ValueError), with every axis of type Auto: shardings inside the program
    are XLA's to propagate (GSPMD) from the pinned ones, not part of the array types."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (see specjax.models.sharding.make_mesh), got {type(mesh).__name__}")
    unknown = set(mesh.axis_names) - set(AXES)
    if unknown:
        raise ValueError(f"mesh axes must be among {AXES}, got {mesh.axis_names}")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return mesh


def axis_size(mesh, name: str) -> int:
    return dict(mesh.shape).get(name, 1)


# ----------------------------------------------------------------------------- specs

def path_str(key_path) -> str:
    """A pytree key path as "a/b/c" (an nnx Variable's trailing "value" dropped)."""
    s = jax.tree_util.keystr(tuple(key_path), simple=True, separator="/")
    return s[: -len("/value")] if s.endswith("/value") else s


def spec_for(path: str, rules: Rules) -> P:
    for pattern, spec in rules:
        if re.search(pattern, path):
            return spec
    return REPLICATED


def fit(spec: P, shape: Sequence[int], mesh_shape: dict) -> P:
    """`spec` for an array of `shape` on a mesh of `mesh_shape`: entries past the array's rank are
    cut, and an axis that the mesh lacks or that does not divide its dimension is dropped."""
    out = []
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        kept, size = [], 1
        for n in names:
            s = mesh_shape.get(n, 0)
            if s >= 1 and dim % (size * s) == 0:
                kept.append(n)
                size *= s
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_specs(tree, rules: Rules):
    """One PartitionSpec per array leaf of `tree` (parameters, or an optimizer state that mirrors
    them: the rules are searched in each leaf's path)."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: spec_for(path_str(kp), rules), tree)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _broadcast(specs, tree):
    """`specs` (a prefix of `tree`, PartitionSpecs at its leaves) broadcast to every leaf of `tree`."""
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree, is_leaf=_is_spec)


def fitted(specs, tree, mesh_shape: dict):
    """Per leaf of `tree`: its spec (from the prefix `specs`) fitted to its shape."""
    return jax.tree.map(lambda s, x: fit(s, np.shape(x), mesh_shape), _broadcast(specs, tree), tree)


def shardings(specs, tree, mesh: Mesh):
    """NamedShardings for every leaf of `tree` (specs fitted to the shapes)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), fitted(specs, tree, dict(mesh.shape)), is_leaf=_is_spec)


def constrain(tree, specs):
    """Inside a traced program: `tree` pinned to `specs` (a prefix of it) on the context mesh, each
    spec fitted to its leaf. Without a mesh in context (the one-device program) `tree` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    leaves_specs = fitted(specs, tree, dict(mesh.shape))
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, leaves_specs)


def batch_partition(tree, batch: int):
    """A default layout for a state pytree of unknown structure (a drafter's): a KV cache as
    `kvcache.partition`, any other array whose leading dimension is the batch over `data`,
    everything else replicated."""

    def leaf(x):
        if isinstance(x, kvcache.KVCache):
            return kvcache.partition(x)
        return BATCH if np.ndim(x) >= 1 and np.shape(x)[0] == batch else REPLICATED

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, kvcache.KVCache))


# ----------------------------------------------------------------------------- placing values

def _key_data(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key) else None


def place_array(x, sharding: NamedSharding):
    """One value on `sharding`. Across processes, each process must pass the same value."""
    data = _key_data(x)
    if data is not None:  # a typed PRNG key: its raw data placed alike, wrapped again
        return jax.random.wrap_key_data(place_array(data, sharding), impl=jax.random.key_impl(x))
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree, specs, mesh: Mesh):
    """Every leaf of `tree` on `mesh` with its spec (`specs`: a prefix of `tree`), fitted to its shape."""
    sh = shardings(specs, tree, mesh)
    return jax.tree.map(place_array, tree, sh)


def place_params(tree, rules: Rules, mesh: Mesh | None):
    """A parameter tree (or a train state that holds parameters and their optimizer state: the rules
    are searched in every leaf's path) laid out on `mesh` by `rules`; without a mesh, on the first
    local device (as a restored checkpoint is, so a resumed run reuses the compiled step)."""
    if mesh is None:
        return jax.device_put(tree, jax.local_devices()[0])
    return place(tree, param_specs(tree, rules), mesh)


def abstract(tree):
    """Shapes, dtypes and shardings of a placed tree: what orbax restores into (a checkpoint saved on
    one layout restores on another, e.g. saved sharded over a mesh, restored on one device). Leaves
    without a sharding (`jax.eval_shape`'s) go to the first local device."""
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or one),
                        tree)


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)`, or nothing without one (`constrain` is then a no-op)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(check_mesh(mesh))


MESH_HELP = ("run on a device mesh: data=D,model=M (D x M devices; data parallel over D, tensor parallel "
             "over M; on CPU simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)")


def gather(x) -> np.ndarray:
    """A (possibly multi-process) array as one host numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ----------------------------------------------------------------------------- several processes

ENV_COORDINATOR = "SPECJAX_COORDINATOR"  # host:port of process 0
ENV_NUM_PROCESSES = "SPECJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPECJAX_PROCESS_ID"


def initialize_distributed(env: dict | None = None) -> bool:
    """`jax.distributed.initialize` from the environment; call it before anything touches a device.

    With SPECJAX_COORDINATOR (host:port of process 0), SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID
    set, every process joins one runtime whose `jax.devices()` holds all processes' devices (a mesh
    over them is global). Without them, JAX's own cluster detection runs when JAX_COORDINATOR_ADDRESS
    or a known cluster environment (SLURM, Open MPI, Kubernetes, Cloud TPU) is present; otherwise
    nothing happens and False is returned. On CPU the gloo collectives are selected, so a cluster of
    CPU processes (and the tests: 2 processes on 127.0.0.1) works."""
    env = os.environ if env is None else env
    if env.get(ENV_COORDINATOR):
        missing = [k for k in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if not env.get(k)]
        if missing:
            raise ValueError(f"{ENV_COORDINATOR} is set; {', '.join(missing)} must be set too")
        kw: dict[str, Any] = dict(coordinator_address=env[ENV_COORDINATOR],
                                  num_processes=int(env[ENV_NUM_PROCESSES]), process_id=int(env[ENV_PROCESS_ID]))
    elif env.get("JAX_COORDINATOR_ADDRESS") or env.get("SLURM_JOB_ID") or env.get("OMPI_COMM_WORLD_SIZE"):
        kw = {}
    else:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's; GPUs use NCCL
    jax.distributed.initialize(**kw)
    return True
