"""The pack's one device mesh: named dims ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``.

Notes: docs/internals.md, "lightning_dist/mesh.py"."""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

# The dim names, defined once, outermost first.
PP, DP_REPLICATE, DP_SHARD, CP, TP = "pp", "dp_replicate", "dp_shard", "cp", "tp"
DIM_NAMES: tuple[str, ...] = (PP, DP_REPLICATE, DP_SHARD, CP, TP)
# The flattened data-parallel dim (dp_replicate x dp_shard): samplers, metrics.
DP = "dp"
# Flattened dims of context parallelism: FSDP2 shards over dp_shard x cp; the loss averages over dp x cp.
DP_SHARD_CP, DP_CP = "dp_shard_cp", "dp_cp"
# expert parallelism's second mesh (DistMesh.expert_meshes): dp_shard x cp (x tp) split into (rest, ep)
EP, EP_OUTER = "ep", "dp_shard_mod_ep"
FLAT_DIMS: dict[str, tuple[str, ...]] = {
    DP: (DP_REPLICATE, DP_SHARD),
    DP_SHARD_CP: (DP_SHARD, CP),
    DP_CP: (DP_REPLICATE, DP_SHARD, CP),
}

Size = Union[int, Literal["auto"]]


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """Sizes of the four mesh dims for one job; ``resolve()`` turns ``"auto"`` into numbers."""

    world_size: int
    """Total number of processes in the job."""
    devices_per_node: int
    """Processes per node; ``"auto"`` data-parallel sizes shard inside a node and replicate across nodes."""
    pp: int = 1
    """Pipeline-parallel degree (outermost dim)."""
    dp_replicate: Size = "auto"
    """Replica groups of hybrid sharding; ``"auto"``: what is left after the other dims."""
    dp_shard: Size = "auto"
    """Ranks one parameter is sharded over; ``"auto"``: the devices of one node left after ``tp``."""
    cp: int = 1
    """Context-parallel degree: ranks one sequence is split over (inside ``dp_shard``, outside ``tp``)."""
    tp: int = 1
    """Tensor-parallel degree (innermost dim, inside a node)."""
    allow_cross_node_tp: bool = False
    """Opt in to a ``tp`` group larger than one node (tensor-parallel traffic belongs inside a node)."""
    arg_names: tuple[tuple[str, str], ...] = ()
    """The argument a user wrote for a dim where it has another name (``(("dp_shard", "shard_size"),)``):
    errors name what was written."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("Invalid device mesh " + self._describe() + ":\n  - " + "\n  - ".join(problems))

    # ---- arithmetic and validation -------------------------------------------------------------
    def _describe(self) -> str:
        dims = ", ".join(self._written(n) for n in DIM_NAMES if n != CP or self.cp != 1)
        return f"({dims}; world_size={self.world_size}, devices_per_node={self.devices_per_node})"

    def _written(self, name: str) -> str:
        """``dp_shard=3``, or ``shard_size=3 (dp_shard)`` when the user wrote the dim under another name."""
        value = getattr(self, name)
        written = dict(self.arg_names).get(name)
        return f"{name}={value!r}" if written is None else f"{written}={value!r} ({name})"

    def _problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("world_size", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"`{name}={value!r}` must be an integer >= 1.")
        for name in DIM_NAMES:
            value = getattr(self, name)
            if value == "auto" and name in (DP_REPLICATE, DP_SHARD):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                allowed = 'an integer >= 1 or "auto"' if name in (DP_REPLICATE, DP_SHARD) else "an integer >= 1"
                problems.append(f"`{self._written(name)}` must be {allowed}.")
            elif value < 1:
                problems.append(f"`{self._written(name)}` must be >= 1; use 1 to switch that dim off.")
        if problems:
            return problems  # the arithmetic below needs valid numbers
        fixed = self.pp * self.cp * self.tp
        if self.world_size % fixed:
            names = "pp x cp x tp" if self.cp > 1 else "pp x tp"
            values = f"{self.pp} x {self.cp} x {self.tp}" if self.cp > 1 else f"{self.pp} x {self.tp}"
            problems.append(
                f"{names} = {values} = {fixed} does not divide world_size={self.world_size};"
                f" choose {names.replace(' x ', ', ')} whose product divides {self.world_size}."
            )
            return problems
        rest = self.world_size // fixed
        rep, shard = self.dp_replicate, self.dp_shard
        if rep != "auto" and shard != "auto" and rep * shard != rest:
            problems.append(
                f"pp x dp_replicate x dp_shard x cp x tp = {self.pp} x {rep} x {shard} x {self.cp} x {self.tp}"
                f" = {self.pp * rep * shard * self.cp * self.tp} != world_size={self.world_size};"
                f" the product of the dims must equal the number of processes"
                f" (e.g. dp_replicate={rest // shard if rest % shard == 0 else 'auto'}, {self._written(DP_SHARD)})."
            )
        for name, value in ((DP_REPLICATE, rep), (DP_SHARD, shard)):
            if value != "auto" and rest % value:
                problems.append(
                    f"`{self._written(name)}` does not divide the {rest} data-parallel ranks"
                    f" (world_size {self.world_size} / (pp x cp x tp) {fixed}); pick a divisor of {rest}."
                )
        if self.tp > self.devices_per_node and not self.allow_cross_node_tp:
            problems.append(
                f"`tp={self.tp}` is larger than devices_per_node={self.devices_per_node}: tensor-parallel traffic"
                " belongs inside a node. Lower tp, or pass allow_cross_node_tp=True to accept it."
            )
        elif self.devices_per_node % self.tp and self.tp < self.devices_per_node:
            problems.append(
                f"`tp={self.tp}` does not divide devices_per_node={self.devices_per_node}: a tp group would"
                " straddle two nodes. Pick a divisor of the devices per node."
            )
        return problems

    def resolve(self) -> "MeshSpec":
        """A copy with ``"auto"`` replaced: dp_shard = devices of a node left after tp, dp_replicate = the rest."""
        rest = self.world_size // (self.pp * self.cp * self.tp)
        rep, shard = self.dp_replicate, self.dp_shard
        if shard == "auto" and rep == "auto":
            per_node = max(1, self.devices_per_node // (self.tp * self.cp))
            shard = math.gcd(per_node, rest)
            rep = rest // shard
        elif shard == "auto":
            shard = rest // rep
        elif rep == "auto":
            rep = rest // shard
        return dataclasses.replace(self, dp_replicate=rep, dp_shard=shard)

    @property
    def resolved(self) -> bool:
        return self.dp_replicate != "auto" and self.dp_shard != "auto"

    def _require_resolved(self) -> None:
        if not self.resolved:
            raise RuntimeError("Call `MeshSpec.resolve()` before asking for shapes or coordinates.")

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in the order of :data:`DIM_NAMES`."""
        self._require_resolved()
        return tuple(getattr(self, n) for n in DIM_NAMES)  # type: ignore[return-value]

    def size(self, name: str) -> int:
        """Size of a dim, or of a flattened dim (``"dp"``, ``"dp_shard_cp"``, ``"dp_cp"``)."""
        self._require_resolved()
        if name in FLAT_DIMS:
            return math.prod(getattr(self, n) for n in FLAT_DIMS[name])
        if name not in DIM_NAMES:
            raise ValueError(f"Unknown mesh dim {name!r}; the dims are {DIM_NAMES + tuple(FLAT_DIMS)}.")
        return getattr(self, name)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each dim, plus its rank inside ``dp``."""
        self._require_resolved()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}.")
        out, rem = {}, rank
        for name, size in zip(reversed(DIM_NAMES), reversed(self.shape)):
            out[name] = rem % size
            rem //= size
        coords = {n: out[n] for n in DIM_NAMES}
        coords[DP] = coords[DP_REPLICATE] * self.dp_shard + coords[DP_SHARD]  # type: ignore[operator]
        return coords

    def group_ranks(self, rank: int, name: str) -> list[int]:
        """Global ranks of the group of `name` (a dim or a flattened dim) that contains `rank`."""
        varying = FLAT_DIMS.get(name, (name,))
        mine = self.coords(rank)
        return [
            r
            for r in range(self.world_size)
            if all(self.coords(r)[d] == mine[d] for d in DIM_NAMES if d not in varying)
        ]

    def plan_rows(self) -> list[dict[str, int]]:
        """One row per rank: ``{"rank", pp, dp_replicate, dp_shard, cp, tp, dp}``."""
        return [{"rank": r, **self.coords(r)} for r in range(self.world_size)]

    def format_plan(self) -> str:
        """The rank -> coordinates table as text (rendered with rich)."""
        from rich.console import Console
        from rich.table import Table

        shape = " x ".join(f"{n}={s}" for n, s in zip(DIM_NAMES, self.shape))
        table = Table(title=f"Device mesh {shape} (world {self.world_size}, {self.devices_per_node}/node)")
        for col in ("rank", "node", *DIM_NAMES, DP):
            table.add_column(col, justify="right")
        for row in self.plan_rows():
            table.add_row(
                str(row["rank"]), str(row["rank"] // self.devices_per_node), *(str(row[c]) for c in (*DIM_NAMES, DP))
            )
        buf = io.StringIO()
        Console(file=buf, width=100, force_terminal=False).print(table)
        return buf.getvalue()


class DistMesh:
    """A built :class:`DeviceMesh` over the four named dims, with the flattened ``dp`` dim.

    Construct with :meth:`build` after the default process group exists.
    """

    def __init__(self, spec: MeshSpec, device_mesh: "DeviceMesh", flat: "dict[str, DeviceMesh]") -> None:
        self.spec = spec
        self.device_mesh = device_mesh
        self._flat = dict(flat)  # the flattened dims are kept here: torch deprecates slicing them from the root
        self._sub: dict[tuple[str, ...], "DeviceMesh"] = {}  # slicing costs ~2 ms a call; the mesh never changes

    @classmethod
    def build(cls, spec: MeshSpec, device_type: str) -> "DistMesh":
        """Build the mesh on `device_type` (cpu -> gloo, cuda -> nccl groups) and check its topology."""
        from torch.distributed.device_mesh import init_device_mesh

        spec = spec if spec.resolved else spec.resolve()
        device_mesh = init_device_mesh(device_type, spec.shape, mesh_dim_names=DIM_NAMES)
        # flatten the two data-parallel dims: samplers and metrics reduce over `dp`
        flat = {DP: device_mesh[(DP_REPLICATE, DP_SHARD)]._flatten(DP)}
        if spec.cp > 1:
            # context parallelism: FSDP2 shards over dp_shard x cp, the loss averages over dp x cp (torchtitan's
            # dims); with cp == 1 they are dp_shard and dp, and no extra process group is made
            flat[DP_SHARD_CP] = device_mesh[(DP_SHARD, CP)]._flatten(DP_SHARD_CP)
            flat[DP_CP] = device_mesh[(DP_REPLICATE, DP_SHARD, CP)]._flatten(DP_CP)
        mesh = cls(spec, device_mesh, flat)
        mesh.check_topology()
        return mesh

    # ---- lookup by name ------------------------------------------------------------------------
    def get_mesh(self, *names: str) -> "DeviceMesh":
        """The sub-mesh over `names` (dims, or one flattened dim: ``"dp"``, ``"dp_shard_cp"``, ``"dp_cp"``)."""
        for n in names:
            if n not in DIM_NAMES + tuple(FLAT_DIMS):
                raise ValueError(f"Unknown mesh dim {n!r}; the dims are {DIM_NAMES + tuple(FLAT_DIMS)}.")
        if len(names) == 1 and names[0] in FLAT_DIMS:
            if names[0] not in self._flat:  # cp == 1: dp_shard_cp is dp_shard, dp_cp is dp
                return self.get_mesh({DP_SHARD_CP: DP_SHARD, DP_CP: DP}[names[0]])
            return self._flat[names[0]]
        if any(n in FLAT_DIMS for n in names):
            raise ValueError(f"Flattened dims cannot be combined with others here: {names}; use `fsdp_mesh()`.")
        if names not in self._sub:
            self._sub[names] = self.device_mesh[names[0] if len(names) == 1 else names]
        return self._sub[names]

    def get_optional_mesh(self, *names: str) -> "DeviceMesh | None":
        """Like :meth:`get_mesh`, but None when every named dim has size 1 (the dim is switched off)."""
        if all(self.spec.size(n) == 1 for n in names):
            return None
        return self.get_mesh(*names)

    def group(self, name: str) -> "ProcessGroup":
        """The process group of dim `name` (or ``"dp"``) that holds this rank."""
        return self.get_mesh(name).get_group()

    def size(self, name: str) -> int:
        """Size of dim `name` (or ``"dp"``)."""
        return self.spec.size(name)

    def local_rank(self, name: str) -> int:
        """This rank's coordinate on dim `name` (its rank inside that group)."""
        return self.get_mesh(name).get_local_rank()

    @property
    def dp_mesh(self) -> "DeviceMesh":
        return self.get_mesh(DP)

    @property
    def dp_group(self) -> "ProcessGroup":
        return self.group(DP)

    @property
    def dp_size(self) -> int:
        return self.spec.size(DP)

    @property
    def dp_rank(self) -> int:
        return self.local_rank(DP)

    def fsdp_mesh(self) -> "DeviceMesh":
        """The mesh FSDP2 shards over: 1-D ``dp_shard`` (x ``cp``) when there is no replication, else 2-D (HSDP)."""
        if self.spec.size(DP_REPLICATE) == 1:
            return self.get_mesh(DP_SHARD_CP)
        if self.spec.cp == 1:
            return self.get_mesh(DP_REPLICATE, DP_SHARD)
        if (DP_REPLICATE, DP_SHARD_CP) not in self._sub:
            from lightning_dist._compat import slice_flattened

            self._sub[(DP_REPLICATE, DP_SHARD_CP)] = slice_flattened(self.device_mesh, (DP_REPLICATE, DP_SHARD_CP))
        return self._sub[(DP_REPLICATE, DP_SHARD_CP)]

    def expert_meshes(self, ep: int) -> "tuple[DeviceMesh, DeviceMesh]":
        """(the ``ep`` mesh, the mesh FSDP2 shards experts over) of expert parallelism: ``dp_shard`` x ``cp`` (x ``tp``
        when `ep` is a multiple of it: :func:`lightning_dist.rules.ep_spans_tp`) split into ``(rest, ep)``
        (consecutive ranks share experts: tp then cp peers first, as torchtitan borrows ep from them) on a second mesh
        over the same ranks in the same order. The experts' FSDP2 mesh is ``dp_replicate`` x ``rest``. Built on first
        use (a collective: every rank calls it at the same point)."""
        if ("ep", ep) not in self._sub:
            from torch.distributed.device_mesh import init_device_mesh

            from lightning_dist.rules import ep_spans_tp

            inner = (DP_SHARD, CP, TP) if ep_spans_tp(ep, self.spec.size(TP)) else (DP_SHARD, CP)  # adjacent dims
            shard = math.prod(self.spec.size(d) for d in inner)
            dims = tuple(d for d in DIM_NAMES if d == DP_SHARD or d not in inner)
            shape = [self.spec.size(d) for d in dims]
            at = dims.index(DP_SHARD)
            names = (*dims[:at], EP_OUTER, EP, *dims[at + 1 :])
            shape[at : at + 1] = [shard // ep, ep]
            root = init_device_mesh(self.device_mesh.device_type, tuple(shape), mesh_dim_names=names)
            fsdp = root[EP_OUTER] if self.spec.size(DP_REPLICATE) == 1 else root[(DP_REPLICATE, EP_OUTER)]
            self._sub[("ep", ep)] = (root[EP], fsdp)
        return self._sub[("ep", ep)]

    @property
    def cp_size(self) -> int:
        return self.spec.cp

    @property
    def loss_group(self) -> "ProcessGroup":
        """The ranks a loss is averaged over: ``dp`` x ``cp`` (cp peers hold parts of the same sequences)."""
        return self.group(DP_CP)

    # ---- self-check ----------------------------------------------------------------------------
    def check_topology(self) -> None:
        """Compare the process groups torch created with the spec (a 2x2 HSDP must never run as 4-way FSDP)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        expected = self.spec.coords(rank)
        problems = []
        coordinate = self.device_mesh.get_coordinate()
        if coordinate is None or tuple(coordinate) != tuple(expected[n] for n in DIM_NAMES):
            problems.append(f"coordinates {coordinate} != planned {[expected[n] for n in DIM_NAMES]}")
        for name in DIM_NAMES + tuple(n for n in FLAT_DIMS if n == DP or self.spec.cp > 1):
            group = self.group(name)
            got = sorted(dist.get_process_group_ranks(group))
            want = self.spec.group_ranks(rank, name)
            if got != want:
                problems.append(f"{name} group ranks {got} != planned {want}")
        if problems:
            raise RuntimeError(f"Device mesh topology check failed on rank {rank}: " + "; ".join(problems))

    def __repr__(self) -> str:
        shape = ", ".join(f"{n}={s}" for n, s in zip(DIM_NAMES, self.spec.shape))
        return f"DistMesh({shape})"


def data_parallel_info(strategy: object) -> tuple["ProcessGroup | None", int, int]:
    """(group, size, rank) of the data-parallel ranks of any Lightning strategy.

    The pack's strategies reduce over their ``dp`` mesh; Lightning's ``ModelParallelStrategy`` over its
    ``data_parallel`` dim; any other strategy (DDP, single device) over the whole world (group None).
    Callbacks use this so tensor/pipeline ranks that saw the same samples are not double-counted.
    """
    import torch.distributed as dist

    mesh = getattr(strategy, "mesh", None)
    if isinstance(mesh, DistMesh):
        return mesh.dp_group, mesh.dp_size, mesh.dp_rank
    device_mesh = getattr(strategy, "_device_mesh", None)
    if device_mesh is not None and "data_parallel" in (device_mesh.mesh_dim_names or ()):
        sub = device_mesh["data_parallel"]
        return sub.get_group(), sub.size(), sub.get_local_rank()
    if dist.is_available() and dist.is_initialized():
        return None, dist.get_world_size(), dist.get_rank()
    return None, 1, 0
