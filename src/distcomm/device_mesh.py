"""``DeviceMesh``: the job's ranks laid out as an n-dimensional array, one process group
per dimension (the API of ``torch.distributed.device_mesh``, on the CPU).

::

    mesh = dist.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    dist.all_reduce(grads, group=mesh.get_group("dp"))   # across data-parallel replicas
    tp = mesh["tp"]                                       # the 1-D mesh of this rank's row

Along each dimension, the ranks that differ only in that dimension's
coordinate form a group (a *line* of the mesh).  Each rank creates the group
of the one line through it per dimension, with ``new_group(...,
use_local_synchronization=True)``, so only a line's members take part in
creating it; a 1-D mesh of every rank of the job uses the default group
itself (as torch's; an n-D mesh's whole-job line gets a group of its own).  Slicing a mesh by dimension names (``mesh["tp"]``, ``mesh["dp",
"tp"]``) reuses the parent's groups; ``_flatten`` makes one group of a mesh's
ranks.  Ranks outside the mesh may create it too: their
:meth:`DeviceMesh.get_coordinate` is None and they own no group of it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import api
from .errors import DistInputError, DistTypeError
from .group import ProcessGroup

__all__ = ["DeviceMesh", "init_device_mesh"]


def _dim_names(names: Any, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise DistTypeError(f"mesh_dim_names must be a tuple of str, got {names!r:.80}")
    names = tuple(names)
    if not all(isinstance(n, str) and n for n in names):
        raise DistTypeError(f"mesh_dim_names must be non-empty strings, got {names!r:.80}")
    if len(names) != ndim:
        raise DistInputError(f"mesh_dim_names {names} names {len(names)} dimensions but the mesh has {ndim}")
    if len(set(names)) != ndim:
        raise DistInputError(f"mesh_dim_names {names} names a dimension twice; each name must be unique")
    return names


def _rank_array(mesh: Any, world_size: int) -> np.ndarray:
    """``mesh`` (nested lists, a NumPy array or a CPU torch tensor of global ranks) as a
    read-only int64 array, checked."""
    if hasattr(mesh, "detach") and hasattr(mesh, "numpy"):
        mesh = mesh.detach().cpu().numpy()
    arr = np.array(mesh)
    if arr.ndim == 0 or arr.size == 0:
        raise DistInputError(f"mesh must be a non-empty array of ranks, got {mesh!r:.80}")
    if arr.dtype.kind not in "iu":
        raise DistTypeError(f"mesh must hold integer ranks, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= world_size)]
    if bad.size:
        raise DistInputError(f"rank {int(bad[0])} in the mesh is not in [0, {world_size})")
    if np.unique(arr).size != arr.size:
        raise DistInputError(f"the mesh lists a rank twice: {arr.tolist()!r:.120}")
    arr.setflags(write=False)
    return arr


class MeshDimError(DistInputError, KeyError):
    """A mesh dimension name that the mesh does not have (a ``KeyError`` too, as torch's)."""


class DeviceMesh:
    """Ranks in an n-dimensional layout with a process group along each dimension.

    Every rank in ``mesh`` must construct it with the same arguments, in the
    same order as its other group creations; ``backend_override`` maps a
    dimension (index or name) to the backend of that dimension's groups.
    """

    def __init__(self, device_type: Any, mesh: Any, *, mesh_dim_names: Sequence[str] | None = None,
                 backend_override: dict[int | str, Any] | None = None, _init_backend: bool = True) -> None:
        world = api._require_world()
        self.device_type = api.cpu_device(device_type, "device_type")
        self._mesh = _rank_array(mesh, world.size)
        self.mesh_dim_names = _dim_names(mesh_dim_names, self._mesh.ndim)
        self._rank = world.rank
        where = np.argwhere(self._mesh == world.rank)
        self._coordinate: list[int] | None = [int(c) for c in where[0]] if len(where) else None
        self._root: DeviceMesh = self
        self._flattened: dict[str, DeviceMesh] = {}
        #: For a mesh made by ``_flatten``: the root's dimensions it joins (None: not known).
        self._merged: tuple[int, ...] | None = None
        backends = self._backends(backend_override)
        self._groups: list[ProcessGroup] = []
        if self._coordinate is not None and _init_backend:
            for d in range(self._mesh.ndim):
                desc = f"mesh:{self.mesh_dim_names[d] if self.mesh_dim_names else d}"
                # (as torch: only a 1-D mesh of the whole job uses the default group; a
                # whole-job line of an n-D mesh gets a group of its own, so that destroying
                # the mesh's groups leaves the default group alone)
                self._groups.append(_group_of(self._line(d), backends.get(d), desc,
                                              may_be_default=self._mesh.ndim == 1))

    # -- construction helpers -----------------------------------------------------------
    def _backends(self, override: dict[int | str, Any] | None) -> dict[int, str]:
        if override is None:
            return {}
        if not isinstance(override, dict):
            raise DistTypeError(f"backend_override must be a dict, got {type(override).__name__}")
        out = {}
        for key, value in override.items():
            backend = value[0] if isinstance(value, tuple) and value else value
            if not isinstance(backend, str):
                raise DistTypeError(
                    f"backend_override[{key!r}] must be a backend name (or (name, options)), got {value!r:.60}"
                )
            out[self._dim_index(key)] = backend
        return out

    def _line(self, d: int) -> list[int]:
        """The global ranks of the line through this rank along dimension ``d``."""
        assert self._coordinate is not None
        index: list[Any] = list(self._coordinate)
        index[d] = slice(None)
        return [int(r) for r in self._mesh[tuple(index)]]

    def _dim_index(self, mesh_dim: int | str) -> int:
        ndim = self._mesh.ndim
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise MeshDimError(
                    f"mesh dimension {mesh_dim!r} does not exist; this mesh's dimensions are "
                    f"{list(self.mesh_dim_names or range(ndim))}"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise DistTypeError(f"mesh_dim must be an int or a dimension name, got {mesh_dim!r:.60}")
        if not -ndim <= mesh_dim < ndim:
            raise DistInputError(f"mesh_dim {mesh_dim} is out of range for a {ndim}-dimensional mesh")
        return mesh_dim % ndim

    def _member(self, what: str) -> list[int]:
        if self._coordinate is None:
            raise DistInputError(f"rank {self._rank} is not in this mesh ({self._mesh.tolist()}), so it has no {what}")
        return self._coordinate

    # -- torch's API ----------------------------------------------------------------------
    @property
    def mesh(self) -> np.ndarray:
        """The global ranks, as a read-only NumPy array of the mesh's shape."""
        return self._mesh

    @property
    def ndim(self) -> int:
        return int(self._mesh.ndim)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``."""
        if mesh_dim is None:
            return int(self._mesh.size)
        return int(self._mesh.shape[self._dim_index(mesh_dim)])

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along each dimension (a tuple, as torch's), or None if it is not
        in the mesh."""
        return None if self._coordinate is None else tuple(self._coordinate)

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The group of this rank's line along ``mesh_dim`` (optional on a 1-D mesh)."""
        self._member("group")
        if mesh_dim is None:
            if self.ndim != 1:
                raise DistInputError(
                    f"this mesh has {self.ndim} dimensions: name one (get_group(mesh_dim)), "
                    f"or use get_all_groups()"
                )
            mesh_dim = 0
        if not self._groups:
            raise DistInputError("this mesh was made with _init_backend=False: it has no groups")
        return self._groups[self._dim_index(mesh_dim)]

    def get_all_groups(self) -> list[ProcessGroup]:
        """The groups of this rank's lines, one per dimension."""
        self._member("group")
        return list(self._groups)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's rank in its group along ``mesh_dim``."""
        return self.get_group(mesh_dim).rank()

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of the named dimensions through this rank (in the mesh's order), or
        a mesh made by ``_flatten``."""
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names) or not names:
            raise DistTypeError(f"index a DeviceMesh with dimension names, got {names!r:.60}")
        flat = self._root._flattened
        if any(n in flat and (self.mesh_dim_names is None or n not in self.mesh_dim_names) for n in names):
            if len(names) == 1:
                return flat[names[0]]
            return self._root._with_flattened(names)
        if self.mesh_dim_names is None:
            raise DistInputError("this mesh has no mesh_dim_names; give them to index it by name")
        dims = [self._dim_index(n) for n in names]
        if dims != sorted(set(dims)):
            raise DistInputError(
                f"dimensions {names} must be distinct and in the mesh's order {self.mesh_dim_names}"
            )
        if len(dims) == self.ndim:
            return self
        coord = self._member("sub-mesh")
        index: list[Any] = [slice(None) if d in dims else coord[d] for d in range(self.ndim)]
        sub = DeviceMesh(self.device_type, self._mesh[tuple(index)], mesh_dim_names=names, _init_backend=False)
        sub._root = self._root
        sub._groups = [self._groups[d] for d in dims] if self._groups else []
        return sub

    def _with_flattened(self, names: tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of the root (this mesh) through this rank along ``names``, some of
        them made by ``_flatten`` (as torch's ``mesh["dp_replicate", "dp_shard_cp"]``): each
        flattened name is one dimension joining the root dimensions it was made of."""
        runs: list[tuple[int, ...]] = []
        groups: list[ProcessGroup] = []
        for n in names:
            flat = self._flattened.get(n)
            if flat is not None and (self.mesh_dim_names is None or n not in self.mesh_dim_names):
                if flat._merged is None:
                    raise DistInputError(f"{n!r} was flattened from a mesh that is not a slice of this "
                                         "one; it can only be used alone")
                runs.append(flat._merged)
                groups.extend(flat._groups)
            else:
                d = self._dim_index(n)
                runs.append((d,))
                groups.extend(self._groups[d : d + 1])
        dims = [d for run in runs for d in run]
        if dims != sorted(set(dims)):
            raise DistInputError(f"dimensions {names} must cover distinct dimensions of the mesh, in its "
                                 f"order {self.mesh_dim_names}")
        coord = self._member("sub-mesh")
        index: list[Any] = [slice(None) if d in dims else coord[d] for d in range(self.ndim)]
        shape = [int(np.prod([self._mesh.shape[d] for d in run])) for run in runs]
        sub = DeviceMesh(self.device_type, self._mesh[tuple(index)].reshape(shape), mesh_dim_names=names,
                         _init_backend=False)
        sub._root = self
        sub._groups = groups
        return sub

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-D mesh of this mesh's ranks (row-major) with one group, named
        ``mesh_dim_name`` (default: the dimension names joined by ``_``); the root mesh
        then finds it by that name too."""
        self._member("flattened mesh")
        if mesh_dim_name is None:
            if self.mesh_dim_names is None:
                raise DistInputError("give mesh_dim_name: this mesh has no dimension names to join")
            mesh_dim_name = "_".join(self.mesh_dim_names)
        if not isinstance(mesh_dim_name, str) or not mesh_dim_name:
            raise DistTypeError(f"mesh_dim_name must be a non-empty str, got {mesh_dim_name!r:.60}")
        ranks = [int(r) for r in self._mesh.reshape(-1)]
        root = self._root
        known = root._flattened.get(mesh_dim_name)
        if known is not None:
            if known._mesh.tolist() != ranks:
                raise DistInputError(
                    f"a flattened mesh named {mesh_dim_name!r} already exists with ranks "
                    f"{known._mesh.tolist()}; choose another name"
                )
            return known
        if self.ndim == 1 and self.mesh_dim_names == (mesh_dim_name,):
            return self  # a 1-D mesh flattened under its own name: itself (as torch's)
        if root.mesh_dim_names is not None and mesh_dim_name in root.mesh_dim_names:
            raise DistInputError(f"{mesh_dim_name!r} already names a dimension of the mesh; choose another name")
        flat = DeviceMesh(self.device_type, ranks, mesh_dim_names=(mesh_dim_name,), _init_backend=False)
        flat._root = root
        if root.mesh_dim_names is not None and self.mesh_dim_names is not None and all(
                n in root.mesh_dim_names for n in self.mesh_dim_names):
            flat._merged = tuple(root.mesh_dim_names.index(n) for n in self.mesh_dim_names)
        flat._groups = [_group_of(ranks, None, f"mesh:{mesh_dim_name}")]
        root._flattened[mesh_dim_name] = flat
        return flat

    @staticmethod
    def from_group(group: ProcessGroup | list[ProcessGroup], device_type: Any, mesh: Any = None, *,
                   mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """A mesh over existing groups: a 1-D mesh of one group's ranks, or an n-D ``mesh``
        with one group per dimension (this rank's line along each)."""
        groups = [group] if isinstance(group, ProcessGroup) else list(group)
        if not groups or not all(isinstance(g, ProcessGroup) for g in groups):
            raise DistTypeError("group must be a ProcessGroup or a list of ProcessGroups")
        if mesh is None:
            if len(groups) != 1:
                raise DistInputError("give mesh when building a DeviceMesh from several groups")
            mesh = list(groups[0].ranks)
        dm = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
        if len(groups) != dm.ndim:
            raise DistInputError(f"{len(groups)} groups for a {dm.ndim}-dimensional mesh: give one per dimension")
        if dm._coordinate is not None:
            for d, g in enumerate(groups):
                if sorted(g.ranks) != sorted(dm._line(d)):
                    raise DistInputError(
                        f"group {d} has ranks {g.ranks} but this rank's line of the mesh along "
                        f"dimension {d} is {dm._line(d)}"
                    )
            dm._groups = groups
        return dm

    # -- identity -----------------------------------------------------------------------
    def _key(self) -> tuple[Any, ...]:
        return (self.device_type, self.shape, self._mesh.tobytes(), self.mesh_dim_names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        dims = ", ".join(
            f"{n}={s}" for n, s in zip(self.mesh_dim_names or [f"dim{d}" for d in range(self.ndim)], self.shape, strict=True)
        )
        return f"DeviceMesh({self.device_type!r}, ({dims}), ranks={self._mesh.tolist()})"


def _group_of(ranks: list[int], backend: str | None, desc: str, may_be_default: bool = True) -> ProcessGroup:
    """The group of ``ranks`` (global): the default group when they are the whole job (and
    ``may_be_default``), else a new group created by its members only."""
    world = api._require_world()
    if may_be_default and backend is None and sorted(ranks) == list(range(world.size)):
        assert world.default is not None
        return world.default
    group = api.new_group(ranks, backend=backend, use_local_synchronization=True, group_desc=desc)
    assert isinstance(group, ProcessGroup)  # this rank is in ranks
    return group


def init_device_mesh(device_type: Any, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None,
                     backend_override: dict[int | str, Any] | None = None) -> DeviceMesh:
    """A mesh of ranks ``0 .. prod(mesh_shape) - 1`` in row-major order, with a group along
    each dimension; initialises the default group from the environment if needed.

    Every rank calls it with the same arguments.  The mesh may leave ranks of the
    job out (they get a mesh without coordinates); it may not need more ranks than
    the job has.
    """
    api.cpu_device(device_type, "device_type")
    given: Any = mesh_shape
    if isinstance(given, numbers.Integral):
        given = (given,)
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or not given:
        raise DistTypeError(f"mesh_shape must be a tuple of positive ints, got {given!r:.60}")
    for s in given:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise DistInputError(f"mesh_shape must be a tuple of positive ints, got {tuple(given)}")
    mesh_shape = tuple(int(s) for s in given)
    _dim_names(mesh_dim_names, len(mesh_shape))
    if not api.is_initialized():
        api.init_process_group()
    world = api._require_world()
    total = math.prod(mesh_shape)
    if total > world.size:
        raise DistInputError(
            f"mesh_shape {tuple(mesh_shape)} needs {total} ranks but the job has {world.size}"
        )
    ranks = np.arange(total).reshape(mesh_shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, backend_override=backend_override)
