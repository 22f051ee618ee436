"""MeshView: a ProcessMesh as a grid of cells (faceted beyond 2 axes), ids and devices per cell."""

from __future__ import annotations

import numpy as np

from ..core import ProcessMesh
from .base import View, target_mesh
from .draw import MAX_W, mesh_block
from .style import GREY

__all__ = ["MeshView", "as_mesh"]

_CELL = np.array([0.74, 0.84, 0.95])


def as_mesh(mesh, dim_names=None) -> ProcessMesh:
    if isinstance(mesh, ProcessMesh):
        return mesh
    if isinstance(mesh, dict):
        return ProcessMesh.from_dict(mesh)
    if hasattr(mesh, "process_mesh"):
        return mesh.process_mesh
    return ProcessMesh(mesh, dim_names)


class MeshView(View):
    """The mesh's cells with their process ids; ranks outside ``within`` (a tensor's mesh or ranks) greyed.

    ``devices``: rank -> device string (or a list indexed by rank); taken from ``source.devices`` for a Cluster.
    ``source``: events; the view then follows the mesh of the latest ``placed``/``reshard`` event and greys ranks
    outside it. ``max_width``: the most inches the picture takes (at 96 px each); facets wrap to it.
    """

    def __init__(self, mesh, within=None, devices=None, title: str | None = None, source=None, interval=0.15,
                 max_width: float = MAX_W):
        self.mesh = as_mesh(mesh)
        self.title = title
        self.max_width = max_width
        if devices is None and source is not None and hasattr(source, "devices"):
            devices = source.devices
        if devices is not None and not isinstance(devices, dict):
            devices = {r: d for r, d in enumerate(devices)}
        self.devices = devices
        self._within = None
        self.set_within(within)
        super().__init__(source=source, interval=interval)

    def set_within(self, within) -> None:
        if within is None:
            self._within = None
        elif isinstance(within, (ProcessMesh, dict)) or hasattr(within, "process_mesh"):
            self._within = set(as_mesh(within).process_ids)
        else:
            self._within = {int(r) for r in within}

    @property
    def cells(self) -> dict:
        """rank -> {'coord', 'device', 'active'}: what each cell shows."""
        out = {}
        for c in np.ndindex(*self.mesh.shape):
            r = self.mesh.rank_at(c)
            out[r] = {
                "coord": c,
                "device": None if not self.devices else self.devices.get(r),
                "active": self._within is None or r in self._within,
            }
        return out

    @property
    def greyed(self) -> list[int]:
        return sorted(r for r, c in self.cells.items() if not c["active"])

    def _ingest(self, events) -> None:
        super()._ingest(events)
        for e in events:
            if e.kind in ("placed", "reshard") and e.mesh:
                tgt = target_mesh(e) if e.kind == "reshard" else None
                self.set_within(tgt or e.mesh)

    def cell_rgb(self) -> np.ndarray:
        rgb = np.broadcast_to(_CELL, tuple(self.mesh.shape) + (3,)).copy()
        if self._within is not None:
            for c in np.ndindex(*self.mesh.shape):
                if self.mesh.rank_at(c) not in self._within:
                    rgb[c] = GREY
        return rgb

    def _block(self):
        return mesh_block(self.mesh, self.cell_rgb(), devices=self.devices, title=self.title or self._heading(),
                          max_w=self.max_width)

    def _heading(self) -> str:
        dims = " × ".join(f"{n}={s}" for n, s in zip(self.mesh.dim_names, self.mesh.shape))
        return f"ProcessMesh {dims}" + (f" ({len(self.greyed)} greyed)" if self.greyed else "")

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.mesh.dim_names, self.mesh.shape))
        grey = f", {len(self.greyed)} greyed" if self._within is not None and self.greyed else ""
        return f"<MeshView {dims}: {self.mesh.size} ranks{grey}>"
