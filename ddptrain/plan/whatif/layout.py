"""Where N ranks live and what one all-reduce costs there: α–β ring collectives over node layouts.

One node: a ring over the intra-node link. Several nodes: a flat ring pays the slower link on every hop; a
hierarchical all-reduce reduce-scatters within the node, all-reduces 1/g of the data across nodes and
all-gathers within the node again (g ranks per node).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain.plan.costs import Link


@dataclass(frozen=True)
class Layout:
    """N ranks as ``nodes`` x ``ranks_per_node``, the links within and between nodes, and the all-reduce shape."""

    world_size: int
    nodes: int
    intra: Link
    inter: Link
    hierarchical: bool = True

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def describe(self) -> str:
        if self.nodes == 1:
            return f"1 node x {self.world_size} ({self.intra.name})"
        ring = "hierarchical" if self.hierarchical else "flat ring"
        return f"{self.nodes} nodes x {self.ranks_per_node} ({self.intra.name} + {self.inter.name}, {ring})"


def _ring(nbytes: float, ranks: int, link: Link, passes: int) -> float:
    """``passes`` ring passes (1: reduce-scatter or all-gather, 2: all-reduce) of ``nbytes`` over ``ranks``."""
    if ranks <= 1:
        return 0.0
    hops = passes * (ranks - 1)
    return hops * link.latency_us * 1e-6 + hops / ranks * nbytes / (link.bandwidth_gbps * 1e9)


def collective_seconds(nbytes: float, layout: Layout, passes: int) -> float:
    """A ring collective of ``nbytes`` over the layout (α–β): ``passes`` 2 is an all-reduce, 1 a reduce-scatter
    or all-gather (``nbytes`` the full, unsharded buffer)."""
    g, m = layout.ranks_per_node, layout.nodes
    if m == 1:
        return _ring(nbytes, g, layout.intra, passes)
    if not layout.hierarchical:  # every hop of one big ring waits for the slowest link
        slow = layout.inter if layout.inter.bandwidth_gbps < layout.intra.bandwidth_gbps else layout.intra
        return _ring(nbytes, g * m, slow, passes)
    return passes * _ring(nbytes, g, layout.intra, 1) + _ring(nbytes / g, m, layout.inter, passes)


def allreduce_seconds(nbytes: float, layout: Layout) -> float:
    """One all-reduce of ``nbytes`` over the layout (α–β, ring)."""
    return collective_seconds(nbytes, layout, 2)
