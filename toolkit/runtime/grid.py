"""Process-group grid: one world of ranks cut into dp x pp x cp x tp (and ep inside dp).

Rank layout (Megatron order, tp fastest)::

    global_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

    world = 8, dp=2, pp=2, tp=2:
        pp0: dp0 -> [0 1]   dp1 -> [2 3]        tp groups  : [0 1] [2 3] [4 5] [6 7]
        pp1: dp0 -> [4 5]   dp1 -> [6 7]        dp groups  : [0 2] [1 3] [4 6] [5 7]
                                                pp groups  : [0 4] [1 5] [2 6] [3 7]

Expert parallelism reuses data-parallel ranks: ``ep`` must divide ``dp`` and each
ep group is ``ep`` consecutive members of one dp group (as in Megatron/DeepSpeed MoE).

Every rank must build the same groups in the same order (``dist.new_group`` is
collective), so :class:`ProcessGrid` creates all of them up front.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

DIMS = ("pp", "dp", "cp", "tp")  # slowest -> fastest


def validate_grid(world_size: int, dp: int | None = None, pp: int = 1, tp: int = 1, cp: int = 1,
                  ep: int = 1) -> dict[str, int]:
    """Check parallel sizes against ``world_size`` and return them with ``dp`` filled in.

    Raises ``ValueError`` naming the parameter and what is allowed; safe to call
    before any process starts.
    """
    for name, value in (("world_size", world_size), ("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rest = pp * tp * cp
    if dp is None:
        if world_size % rest:
            raise ValueError(f"world_size={world_size} is not divisible by pp*tp*cp={rest}; "
                             f"allowed: world_size a multiple of {rest}")
        dp = world_size // rest
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    if dp * rest != world_size:
        raise ValueError(f"world_size={world_size} must equal dp*pp*cp*tp={dp}*{pp}*{cp}*{tp}={dp * rest}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} (expert groups are carved out of data-parallel ranks)")
    return {"dp": dp, "pp": pp, "tp": tp, "cp": cp, "ep": ep}


@dataclass
class ProcessGrid:
    """Groups and coordinates of this rank in a dp x pp x cp x tp (+ep) grid.

    Build it inside a rank with ``ProcessGrid.build(world_size, rank, tp=2, pp=2)``.
    ``group(name)`` gives the ``ProcessGroup`` for ``"dp"``, ``"pp"``, ``"tp"``,
    ``"cp"``, ``"ep"`` or ``"world"``; ``ranks(name)`` its global ranks;
    ``rank_in(name)`` this rank's index in it.
    """

    sizes: dict[str, int]
    rank: int
    coords: dict[str, int] = field(default_factory=dict)
    _groups: dict[str, object] = field(default_factory=dict, repr=False)
    _ranks: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, world_size: int, rank: int, **sizes: int) -> "ProcessGrid":
        sizes = validate_grid(world_size, **sizes)
        grid = cls(sizes=sizes, rank=rank)
        shape = [sizes[d] for d in DIMS]
        coord_of = {}
        for coord in itertools.product(*[range(s) for s in shape]):
            g = 0
            for d, c in zip(DIMS, coord):
                g = g * sizes[d] + c
            coord_of[g] = dict(zip(DIMS, coord))
        grid.coords = coord_of[rank]
        for dim in DIMS:  # one group per slice along `dim`, all created in the same order on all ranks
            others = [d for d in DIMS if d != dim]
            for fixed in itertools.product(*[range(sizes[d]) for d in others]):
                members = sorted(g for g, c in coord_of.items()
                                 if all(c[d] == f for d, f in zip(others, fixed)))
                grp = dist.new_group(members) if dist.is_initialized() else None
                if rank in members:
                    grid._groups[dim], grid._ranks[dim] = grp, members
        ep = sizes["ep"]
        dp_members_all = []  # ep groups: consecutive chunks of each dp group
        for fixed in itertools.product(*[range(sizes[d]) for d in ("pp", "cp", "tp")]):
            members = sorted(g for g, c in coord_of.items()
                             if (c["pp"], c["cp"], c["tp"]) == fixed)
            dp_members_all.append(members)
        for members in dp_members_all:
            for i in range(0, len(members), ep):
                chunk = members[i:i + ep]
                grp = dist.new_group(chunk) if dist.is_initialized() else None
                if rank in chunk:
                    grid._groups["ep"], grid._ranks["ep"] = grp, chunk
        grid._groups["world"] = dist.group.WORLD if dist.is_initialized() else None
        grid._ranks["world"] = list(range(world_size))
        return grid

    def group(self, name: str):
        self._check(name)
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        self._check(name)
        return self._ranks[name]

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def rank_in(self, name: str) -> int:
        return self.ranks(name).index(self.rank)

    def _check(self, name: str) -> None:
        if name not in self._ranks:
            raise ValueError(f"unknown group {name!r}; allowed: {sorted(self._ranks)}")


# ---- which ranks share a node ----------------------------------------------------------------------------------
@dataclass
class Topology:
    """This rank's place in ``nodes`` × ``local`` ranks (consecutive ranks share a node, as ``Cluster.node_of``
    places them) and the two groups that two-level collectives use::

        world = 4, local = 2:   node 0 -> [0 1]   node 1 -> [2 3]       intra: [0 1] [2 3]   (NVLink)
                                                                        inter: [0 2] [1 3]   (one NIC rail)
    """

    nodes: int
    local: int
    node: int
    local_rank: int
    intra: object  # the ``local`` ranks of this node
    inter: object  # the ``nodes`` ranks with this local index


def node_groups(local: int, ledger=None) -> Topology:
    """Build (collectively: every rank creates every group, in the same order) the intra-node and inter-node groups
    of ``local`` ranks per node; label them in ``ledger``. ValueError unless ``local`` divides the world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(local, int) or isinstance(local, bool) or local < 1 or world % local:
        raise ValueError(f"ranks per node {local!r} must be a positive int dividing world_size={world}")
    nodes = world // local
    intra = inter = None
    for a in range(nodes):
        g = dist.new_group(list(range(a * local, (a + 1) * local)))
        intra = g if rank // local == a else intra
    for lr in range(local):
        g = dist.new_group(list(range(lr, world, local)))
        inter = g if rank % local == lr else inter
    if ledger is not None:
        ledger.name_group(intra, "intra-node")
        ledger.name_group(inter, "inter-node")
    return Topology(nodes, local, rank // local, rank % local, intra, inter)
